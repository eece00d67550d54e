"""The chat page (clients/web/) in headless Chromium against a live wsserver.

The page is driven like a user drives it (typing, Enter, clicks) through
Playwright's auto-waiting locators; what cannot be seen from outside — when a
click happened, when the UI went idle, when text was appended — is measured
inside the page with performance.now() and MutationObservers.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from .conftest import ROOT, LiveServer, ms, reference_text, save_artifact

pytestmark = pytest.mark.browser

expect: Any
try:
    from playwright.sync_api import expect
except ImportError:  # the browser fixture skips or fails with the reason
    expect = None


# ---------------------------------------------------------------------- helpers


def open_chat(page: Any, server: LiveServer) -> None:
    page.goto(server.http_url)
    expect(page.locator("#app")).to_have_attribute("data-connection", "open")
    expect(page.locator("#model")).to_have_text("fake")


def set_options(
    page: Any,
    *,
    max_tokens: int | None = None,
    seed: int | None = None,
    temperature: float | None = None,
) -> None:
    if max_tokens is not None:
        page.fill("#max-tokens", str(max_tokens))
    if seed is not None:
        page.fill("#seed", str(seed))
    if temperature is not None:
        page.fill("#temperature", str(temperature))


def send(page: Any, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_answer(page: Any) -> Any:
    return page.locator(".message.assistant .text").last


def wait_text(page: Any, chars: int) -> None:
    """Wait until the streaming answer has shown at least ``chars`` characters."""
    page.wait_for_function(
        "chars => (document.querySelector('.message.assistant:last-of-type .text')"
        "?.textContent.length ?? 0) >= chars",
        arg=chars,
    )


def last_done(page: Any) -> dict[str, Any]:
    """The `done` frame of the latest answer (waits for it)."""
    return page.evaluate("() => window.chat.last().done")  # type: ignore[no-any-return]


def messages_for(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


# ---------------------------------------------------------------------- tests


def test_page_streams_what_the_python_client_receives(page: Any, live_server: LiveServer) -> None:
    prompt = "Tell me about streams, in 日本語 too."
    open_chat(page, live_server)

    # Shift+Enter is a newline, not a send.
    page.fill("#prompt", "first line")
    page.press("#prompt", "Shift+Enter")
    page.keyboard.type("second line")
    expect(page.locator("#prompt")).to_have_value("first line\nsecond line")
    expect(page.locator(".message")).to_have_count(0)

    set_options(page, max_tokens=120, seed=42, temperature=0.8)
    send(page, prompt)
    expect(page.locator(".message.user .text")).to_have_text(prompt)
    expect(page.locator("#prompt")).to_have_value("")
    done = last_done(page)
    expect(page.locator("#app")).to_have_attribute("data-state", "idle")

    expected, reference_done = reference_text(
        live_server, messages=messages_for(prompt), max_tokens=120, seed=42, temperature=0.8
    )
    assert last_answer(page).text_content() == expected
    assert len(expected) > 100
    assert done["reason"] == reference_done["reason"] == "length"
    assert done["usage"]["completion_tokens"] == reference_done["completion_tokens"] == 120
    # The server's exact numbers replace the live estimates at the end.
    expect(page.locator("#stat-tokens")).to_have_text("120")
    expect(page.locator(".message.assistant .meta")).to_contain_text("120 tokens")


def test_rendering_appends_once_per_animation_frame(page: Any, live_server_factory: Any) -> None:
    """Text arriving between two frames lands as one appended text node, and
    existing text is never rewritten."""
    server = live_server_factory(
        **{"backend.fake.tokens_per_s": 2000, "stream.flush_ms": 2, "stream.flush_tokens": 1}
    )
    open_chat(page, server)
    set_options(page, max_tokens=3000)
    page.evaluate(
        """() => {
            const probe = window.__render = { frames: 0, deltas: 0, added: 0, changed: 0, removed: 0 };
            const tick = () => { probe.frames++; if (!probe.stop) requestAnimationFrame(tick); };
            requestAnimationFrame(tick);
            window.chat.client.on('frame', (f) => { if (f.type === 'delta') probe.deltas++; });
            new MutationObserver((records) => {
                for (const r of records) {
                    if (r.type === 'characterData') probe.changed++;
                    probe.added += r.addedNodes.length;
                    probe.removed += r.removedNodes.length;
                }
            }).observe(document.getElementById('log'), { childList: true, characterData: true, subtree: true });
        }"""
    )
    send(page, "a fast one")
    last_done(page)
    probe = page.evaluate("() => { window.__render.stop = true; return window.__render; }")
    nodes = page.evaluate(
        """() => {
            const walker = document.createTreeWalker(
                document.querySelector('.message.assistant .text'), NodeFilter.SHOW_TEXT);
            let count = 0;
            while (walker.nextNode()) count++;
            return count;
        }"""
    )
    # Several deltas per frame at this rate, but one text node per frame.
    assert probe["deltas"] > 100
    assert nodes <= probe["frames"] + 1
    assert nodes < probe["deltas"]
    assert probe["changed"] == 0
    assert probe["removed"] == 0


def test_stop_ends_the_stream_and_the_ui_is_idle_within_100ms(
    page: Any, live_server: LiveServer
) -> None:
    open_chat(page, live_server)
    set_options(page, max_tokens=4000)  # 20 s at 200 tokens/s: still running when stopped
    send(page, "stop me")
    wait_text(page, 40)
    page.evaluate(
        """() => {
            const app = document.getElementById('app');
            const stream = window.chat.current();
            const text = document.querySelector('.message.assistant:last-of-type .text');
            const probe = window.__probe = {
                id: stream.id, clickAt: null, idleAt: null, textAtClick: null,
                doneAt: null, mutationTimes: [], deltasAfterClick: 0,
            };
            // Capture phase on the document: runs before the button's own handler.
            document.addEventListener('click', (event) => {
                if (event.target.id !== 'stop') return;
                probe.clickAt = performance.now();
                probe.textAtClick = stream.text;
            }, { capture: true });
            new MutationObserver(() => {
                if (app.dataset.state === 'idle' && probe.idleAt === null) probe.idleAt = performance.now();
            }).observe(app, { attributes: true, attributeFilter: ['data-state'] });
            new MutationObserver(() => probe.mutationTimes.push(performance.now()))
                .observe(text, { childList: true, characterData: true, subtree: true });
            window.chat.client.on('frame', (frame) => {
                if (frame.id !== stream.id) return;
                if (frame.type === 'delta' && probe.clickAt !== null) probe.deltasAfterClick++;
                if (frame.type === 'done') probe.doneAt = performance.now();
            });
            // Resolves ten animation frames after the done: time for any late text to show.
            window.__settled = stream.done.then(async (done) => {
                for (let i = 0; i < 10; i++) await new Promise(requestAnimationFrame);
                return { done, final: text.textContent };
            });
        }"""
    )
    page.click("#stop")
    settled = page.evaluate("() => window.__settled")
    probe = page.evaluate("() => window.__probe")

    assert settled["done"]["reason"] == "cancelled"
    assert probe["clickAt"] is not None and probe["idleAt"] is not None
    assert probe["idleAt"] - probe["clickAt"] < 100, probe
    # Nothing after the click: the answer is exactly what had arrived before it.
    assert settled["final"] == probe["textAtClick"]
    assert len(settled["final"]) >= 40
    # No text appended after the done frame (or after the click, at all).
    assert probe["doneAt"] is not None
    assert all(t <= probe["doneAt"] for t in probe["mutationTimes"]), probe
    assert all(t <= probe["clickAt"] + 100 for t in probe["mutationTimes"]), probe

    expect(page.locator("#app")).to_have_attribute("data-state", "idle")
    expect(page.locator("#stop")).to_be_disabled()
    expect(page.locator("#activity")).to_have_text("Stopped")
    expect(page.locator(".message.assistant .meta")).to_contain_text("stopped")

    # Esc stops too, and the next answer starts cleanly after a stop.
    send(page, "and stop this one with Esc")
    wait_text(page, 1)
    page.keyboard.press("Escape")
    expect(page.locator("#app")).to_have_attribute("data-state", "idle")
    assert last_done(page)["reason"] == "cancelled"
    expect(page.locator(".message.assistant")).to_have_count(2)


def test_regenerate_replaces_the_answer_without_leaking_old_text(
    page: Any, live_server: LiveServer
) -> None:
    prompt = "regenerate me"
    open_chat(page, live_server)
    set_options(page, max_tokens=3000, seed=1)
    send(page, prompt)
    wait_text(page, 20)
    page.evaluate(
        """() => {
            const seen = window.__frames = { ids: [], deltaIds: new Set(), done: {} };
            window.chat.client.on('frame', (f) => {
                if (f.type === 'delta') seen.deltaIds.add(f.id);
                if (f.type === 'done') seen.done[f.id] = f.reason;
            });
        }"""
    )
    first_id = page.evaluate("() => window.chat.last().id")

    # Clicks as fast as Playwright makes them, each with a new seed ...
    for seed in (2, 3):
        page.fill("#seed", str(seed))
        page.click("#regenerate")
    # ... then a burst within one task: faster than any user, and faster
    # than the server can wind down each old producer.
    page.evaluate(
        """() => {
            const seed = document.getElementById('seed');
            const maxTokens = document.getElementById('max-tokens');
            const regenerate = document.getElementById('regenerate');
            for (const value of [4, 5, 6, 9]) {
                seed.value = String(value);
                if (value === 9) maxTokens.value = '80';
                regenerate.click();
            }
        }"""
    )
    done = last_done(page)
    final_id = page.evaluate("() => window.chat.last().id")
    expect(page.locator("#app")).to_have_attribute("data-state", "idle")

    expected, _ = reference_text(
        live_server, messages=messages_for(prompt), max_tokens=80, seed=9, temperature=0.8
    )
    other, _ = reference_text(
        live_server, messages=messages_for(prompt), max_tokens=80, seed=1, temperature=0.8
    )
    assert expected != other  # the seeds differ, so leaked text would show
    assert done["reason"] == "length"
    assert last_answer(page).text_content() == expected
    expect(page.locator(".message.assistant")).to_have_count(1)
    expect(page.locator(".notice")).to_have_count(0)

    # Every replaced request ended as cancelled (or had ended) on the server.
    frames = page.evaluate(
        "() => ({ done: window.__frames.done, deltaIds: [...window.__frames.deltaIds] })"
    )
    replaced = [i for i in frames["done"] if i != final_id]
    assert first_id in replaced
    assert len(replaced) == 6
    assert all(frames["done"][i] in ("cancelled", "length") for i in replaced)


def test_main_thread_stays_responsive_at_a_very_high_token_rate(
    page: Any, live_server_factory: Any
) -> None:
    # 5,000 tokens/s is a hundred times a local model, with ~1,000 delta frames
    # a second. WSSERVER_TEST_HIGH_RATE=0 runs the fake backend flat out
    # (~100,000 tokens/s), which on a 2-core machine mostly measures the CPU
    # contention between server, browser and test driver.
    rate = float(os.environ.get("WSSERVER_TEST_HIGH_RATE", "5000"))
    server = live_server_factory(**{"backend.fake.tokens_per_s": rate})
    open_chat(page, server)
    # A short answer first, so that the one-off loading of the CJK and emoji
    # fonts is not measured as if the stream had caused it.
    set_options(page, max_tokens=300)
    send(page, "warm up")
    last_done(page)
    page.evaluate(
        """() => {
            const app = document.getElementById('app');
            const probe = window.__perf = { longTasks: [], events: [], inputs: [], deltas: 0 };
            const streaming = () => app.dataset.state === 'streaming';
            new PerformanceObserver((list) => {
                for (const e of list.getEntries()) probe.longTasks.push(e.duration);
            }).observe({ type: 'longtask' });
            // Event Timing: from the input event to the next paint after its handlers.
            new PerformanceObserver((list) => {
                for (const e of list.getEntries()) {
                    if (streaming()) probe.events.push({ name: e.name, duration: e.duration });
                }
            }).observe({ type: 'event', durationThreshold: 16 });
            // Our own measure: input event to the frame after it (rAF, then a task).
            for (const type of ['pointerdown', 'keydown']) {
                document.addEventListener(type, (event) => {
                    const start = event.timeStamp;
                    const during = streaming();
                    requestAnimationFrame(() => setTimeout(() => {
                        probe.inputs.push({ type, streaming: during, latency: performance.now() - start });
                    }, 0));
                }, { capture: true });
            }
            window.chat.client.on('frame', (f) => { if (f.type === 'delta') probe.deltas++; });
        }"""
    )
    set_options(page, max_tokens=1_000_000)
    send(page, "as fast as you can")
    wait_text(page, 20_000)

    # Interact during the stream: type into the prompt, use the controls.
    page.click("#prompt")
    page.keyboard.type("typing while it streams")
    page.click("#seed")
    page.keyboard.type("12")
    page.click("#temperature")
    page.click("#prompt")
    expect(page.locator("#prompt")).to_have_value("typing while it streams")
    expect(page.locator("#seed")).to_have_value("12")
    wait_text(page, 100_000)
    page.click("#stop")
    done = last_done(page)
    perf = page.evaluate("() => window.__perf")
    chars = page.evaluate(
        "() => document.querySelector('.message.assistant:last-of-type .text').textContent.length"
    )

    assert done["reason"] == "cancelled"  # it was still streaming after all the input
    assert done["timings"]["tokens_per_s"] > 0.8 * rate
    assert perf["deltas"] > 2000
    streaming_inputs = [i for i in perf["inputs"] if i["streaming"]]
    assert len(streaming_inputs) >= 25, perf["inputs"]
    worst_input = max(i["latency"] for i in streaming_inputs)
    worst_event = max((e["duration"] for e in perf["events"]), default=0.0)
    worst_task = max(perf["longTasks"], default=0.0)
    print(
        f"\nhigh rate: {done['timings']['tokens_per_s']:.0f} tok/s, {perf['deltas']} deltas, "
        f"{chars} chars; worst input-to-frame {worst_input:.1f} ms, worst event timing "
        f"{worst_event:.1f} ms, long tasks {[round(t) for t in perf['longTasks']]}"
    )
    # 100 ms is where a response stops feeling instant (RAIL's budget). With
    # the answer in one growing paragraph (before it was split into blocks),
    # relayout made a 50-70 ms task of nearly every frame past ~60k characters
    # (1.7 s of long tasks in total here) and 200-600 ms tasks at full speed.
    # A loaded CI runner may still preempt a task now and then: some slack.
    assert worst_input < 100, perf["inputs"]
    assert worst_event < 100, [e for e in perf["events"] if e["duration"] > 50]
    assert worst_task < 150, perf["longTasks"]
    assert sum(perf["longTasks"]) < 300, perf["longTasks"]


def test_queue_position_is_shown_while_queued(page: Any, live_server_factory: Any) -> None:
    from wsserver_client.client import Client

    server = live_server_factory(**{"backend.fake.parallel": 1})
    holder: dict[str, Any] = {}

    async def occupy() -> None:
        client = Client(server.ws_url)
        await client.connect()
        stream = client.generate(prompt="hold the only slot", max_tokens=100_000)
        text = stream.__aiter__()
        await text.__anext__()  # streaming: the only slot is taken
        holder.update(client=client, stream=stream, text=text)

    async def release() -> None:
        await holder["client"].cancel(holder["stream"].id)
        await holder["text"].aclose()
        await holder["client"].close()

    server.call(occupy)
    try:
        open_chat(page, server)
        send(page, "wait for your turn")
        expect(page.locator("#app")).to_have_attribute("data-state", "queued")
        expect(page.locator("#activity")).to_have_text("Queued — position 1")
    finally:
        server.call(release)
    expect(page.locator("#app")).to_have_attribute("data-state", re.compile("streaming|idle"))
    wait_text(page, 1)


@pytest.mark.parametrize("context", [{"csp": True}], indirect=True)
def test_page_works_under_its_content_security_policy(page: Any, live_server: LiveServer) -> None:
    page.add_init_script(
        """window.__violations = [];
        document.addEventListener('securitypolicyviolation',
            (e) => window.__violations.push(e.violatedDirective + ' ' + e.blockedURI));"""
    )
    response = page.goto(live_server.http_url)
    policy = response.headers["content-security-policy"]
    assert "connect-src 'self'" in policy and "script-src 'self'" in policy
    assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
    expect(page.locator("#app")).to_have_attribute("data-connection", "open")
    set_options(page, max_tokens=20)
    send(page, "under CSP")
    expect(page.locator(".message.assistant .meta")).to_contain_text("20 tokens")
    assert page.evaluate("() => window.__violations") == []


def test_connection_state_is_shown_and_recovers(page: Any, live_server: LiveServer) -> None:
    open_chat(page, live_server)
    expect(page.locator("#connection-text")).to_have_text("Connected")
    set_options(page, max_tokens=4000)
    send(page, "interrupted")
    wait_text(page, 10)

    # The connection drops (the server side aborts it): the answer in flight
    # ends with an error, not silently, and the page reconnects by itself.
    assert live_server.drop_connections() == 1
    expect(page.locator(".message.assistant .notice")).to_contain_text("connection dropped")
    expect(page.locator("#app")).to_have_attribute("data-state", "idle")
    expect(page.locator("#app")).to_have_attribute("data-connection", "open", timeout=ms(20))

    # The server goes away for a while: the page says so, and retries.
    live_server.stop()
    expect(page.locator("#app")).to_have_attribute(
        "data-connection", re.compile("reconnecting|connecting")
    )
    expect(page.locator("#connection-text")).to_contain_text(re.compile("retrying|Connecting"))
    expect(page.locator("#send")).to_be_disabled()

    live_server.start()
    expect(page.locator("#app")).to_have_attribute("data-connection", "open", timeout=ms(20))
    expect(page.locator("#connection-text")).to_have_text("Connected")
    # Regenerate after a reconnect sends the remembered input afresh.
    set_options(page, max_tokens=30)
    page.click("#regenerate")
    expect(page.locator(".message.assistant .meta")).to_contain_text("30 tokens")
    expect(page.locator(".notice")).to_have_count(0)


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_screenshot_mid_stream(browser: Any, live_server_factory: Any, scheme: str) -> None:
    """Saves artifacts/page-mid-stream[-dark].png and, when missing (or with
    WSSERVER_UPDATE_SCREENSHOT=1), docs/screenshot.png for the README."""
    server = live_server_factory(**{"backend.fake.tokens_per_s": 30})
    context = browser.new_context(
        viewport={"width": 1000, "height": 720},
        color_scheme=scheme,
        bypass_csp=True,
        reduced_motion="reduce",
    )
    context.set_default_timeout(ms(20))
    try:
        page = context.new_page()
        open_chat(page, server)
        set_options(page, max_tokens=24, seed=3)
        send(page, "Say hello to the people reading the README.")
        last_done(page)
        set_options(page, max_tokens=400, seed=5)
        send(page, "Now stream something longer,\nso the screenshot shows text arriving.")
        wait_text(page, 160)
        expect(page.locator("#app")).to_have_attribute("data-state", "streaming")
        expect(page.locator("#stop")).to_be_enabled()
        suffix = "" if scheme == "light" else "-dark"
        page.screenshot(path=save_artifact(f"page-mid-stream{suffix}.png"))
        docs = ROOT / "docs" / "screenshot.png"
        if scheme == "light" and (
            not docs.exists() or os.environ.get("WSSERVER_UPDATE_SCREENSHOT") == "1"
        ):
            page.screenshot(path=docs)
        assert Path(save_artifact(f"page-mid-stream{suffix}.png")).stat().st_size > 10_000
    finally:
        context.close()


def test_page_takes_a_token_from_the_url_fragment(browser: Any, live_server_factory: Any) -> None:
    """``/#token=…`` reaches the server as the bearer subprotocol and leaves the address bar."""
    import base64

    token = "s3cret-token"
    server = live_server_factory(**{"security.auth_token": token})
    # The page itself is behind the token too (HTTP Basic, token as password).
    basic = base64.b64encode(f"user:{token}".encode()).decode()
    context = browser.new_context(
        extra_http_headers={"Authorization": f"Basic {basic}"}, bypass_csp=True
    )
    context.set_default_timeout(ms(10))
    try:
        page = context.new_page()
        page.goto(server.http_url + "#token=" + token)
        expect(page.locator("#app")).to_have_attribute("data-connection", "open")
        assert "token" not in page.url

        async def offered() -> list[str]:
            assert server.server is not None
            return [
                c.ws.request.headers.get("Sec-WebSocket-Protocol", "")
                for c in server.server.connections.values()
                if c.ws.request is not None
            ]

        assert server.call(offered) == [f"wsserver.v1, bearer.{token}"]
        set_options(page, max_tokens=5)
        send(page, "authorized")
        expect(page.locator(".message.assistant .meta")).to_contain_text("5 tokens")
    finally:
        context.close()
