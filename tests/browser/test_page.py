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

from .chat import (
    expect,
    last_answer,
    last_done,
    messages_for,
    open_chat,
    send,
    set_options,
    wait_text,
)
from .conftest import ROOT, LiveServer, ms, reference_text, save_artifact

pytestmark = pytest.mark.browser


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


def test_stop_ends_the_stream_and_the_ui_is_idle_at_once(
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
                id: stream.id, clicked: false, textAtClick: null, stateAfterClick: null,
                clickTaskOver: false, doneSeen: false, mutationsLater: 0, deltasAfterClick: 0,
            };
            // Capture phase on the document: runs before the button's own handler ...
            document.addEventListener('click', (event) => {
                if (event.target.id !== 'stop') return;
                probe.clicked = true;
                probe.textAtClick = stream.text;
            }, { capture: true });
            // ... bubble phase: after it, in the same task.
            document.addEventListener('click', (event) => {
                if (event.target.id !== 'stop') return;
                probe.stateAfterClick = app.dataset.state;
                setTimeout(() => { probe.clickTaskOver = true; }, 0);
            });
            new MutationObserver(() => {
                if (probe.clickTaskOver) probe.mutationsLater++;
            }).observe(text, { childList: true, characterData: true, subtree: true });
            window.chat.client.on('frame', (frame) => {
                if (frame.id !== stream.id) return;
                if (frame.type === 'delta' && probe.clicked) probe.deltasAfterClick++;
                if (frame.type === 'done') probe.doneSeen = true;
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
    # Idle within the click's own task, before any frame from the server.
    assert probe["stateAfterClick"] == "idle", probe
    # Nothing after the click: the answer is exactly what had arrived before it,
    # rendered within the click's task and never touched again.
    assert settled["final"] == probe["textAtClick"]
    assert len(settled["final"]) >= 40
    assert probe["doneSeen"] and probe["clickTaskOver"]
    assert probe["mutationsLater"] == 0, probe

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
    set_options(page, max_tokens=400)
    send(page, "interrupted")
    wait_text(page, 10)

    # The connection drops (the server side aborts it): the page reconnects
    # by itself and the answer in flight is resumed, whole (it is resumable).
    assert live_server.drop_connections() == 1
    expect(page.locator("#app")).to_have_attribute("data-connection", "open", timeout=ms(20))
    assert last_done(page)["reason"] == "length"
    expect(page.locator(".message.assistant .meta")).to_contain_text("400 tokens")
    expect(page.locator(".message.assistant .notice")).to_have_count(0)
    expect(page.locator("#app")).to_have_attribute("data-state", "idle")

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


SCREENSHOT_ANSWER = """\
## Streaming without the freeze

The page renders each **finished block once** and re-renders only the last
one, so a long answer costs no more per frame than a short one. Three things
keep it calm:

1. The server sends at most one `delta` per `flush_ms` window.
2. Text that arrives between two frames is rendered once, in the next frame.
3. Model output is *sanitized*: raw HTML shows as text.

| setting | default | what it bounds |
|---|---:|---|
| `flush_ms` | 30 | frames per second |
| `queue_tokens` | 64 | memory per request |

```python
async with Client("ws://127.0.0.1:8765/") as client:
    async for text in client.generate("Write a haiku", max_tokens=64):
        print(text, end="", flush=True)
```

> Stop cancels in-band: the model stops within one step.
"""

# Two earlier conversations in the sidebar, as a returning user has them.
SCREENSHOT_HISTORY = """
localStorage.setItem('wsserver.chat.v1', JSON.stringify({
    version: 1, currentId: 'old2', conversations: [
        { id: 'old2', title: 'Cancel during a long prompt', updated: 2, messages: [
            { role: 'user', content: 'Cancel during a long prompt' },
            { role: 'assistant', content: 'It stops within one step.', meta: 'finished' }] },
        { id: 'old1', title: 'Why bound the channel?', updated: 1, messages: [
            { role: 'user', content: 'Why bound the channel?' },
            { role: 'assistant', content: 'So memory has a ceiling.', meta: 'finished' }] },
    ] }));
"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_screenshot_mid_stream(
    browser: Any, live_server_factory: Any, scheme: str, tmp_path: Path
) -> None:
    """Saves artifacts/page-mid-stream[-dark].png and, when missing (or with
    WSSERVER_UPDATE_SCREENSHOT=1), docs/screenshot.png for the README."""
    answer = tmp_path / "answer.md"
    answer.write_text(SCREENSHOT_ANSWER, encoding="utf-8")
    server = live_server_factory(
        **{"backend.fake.tokens_per_s": 40, "backend.fake.text_file": str(answer)}
    )
    context = browser.new_context(
        viewport={"width": 1100, "height": 940},
        color_scheme=scheme,
        bypass_csp=True,
        reduced_motion="reduce",
    )
    context.set_default_timeout(ms(20))
    try:
        page = context.new_page()
        page.add_init_script(
            "if (!sessionStorage.getItem('seeded')) {"
            + SCREENSHOT_HISTORY
            + "sessionStorage.setItem('seeded', '1'); }"
        )
        open_chat(page, server)
        expect(page.locator("#history li")).to_have_count(2)
        page.click("#new-chat")
        set_options(page, max_tokens=400, seed=5)
        send(page, "How does the page stay responsive while the model streams?")
        # Mid-stream: inside the code block, after the table.
        expect(page.locator(".message.assistant figure.code .lang")).to_have_text("python")
        page.wait_for_function(
            "() => (document.querySelector('.message.assistant figure.code code')"
            "?.textContent.length ?? 0) > 80"
        )
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
