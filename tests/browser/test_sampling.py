"""The chat page's "Sampling" disclosure: temperature, the repetition
penalty and its window, min_p and a JSON switch — kept across reloads, sent
on every generate and restart, left out at their defaults where the engine
does not honour them (``hello.honours``), and a refusal shown, not fatal.

The frames are observed as the page sends them (Playwright's ``framesent``),
and every wait is on a condition of the page.
"""

from __future__ import annotations

import json
from typing import Any

from wsserver.backends.fake import FakeBackend
from wsserver.core.sampling import NEUTRAL

from .chat import expect, last_answer, open_chat, open_sampling, send
from .conftest import LiveServer, save_artifact


class HonouringFake(FakeBackend):
    """The fake engine declaring every option honoured, as the llama engine
    does: the page then sends its defaults. (It still ignores the penalties;
    these tests look at what is asked, not at the text.)"""

    honours = frozenset(NEUTRAL)


def record_sent(page: Any) -> list[dict[str, Any]]:
    """The page's client frames, decoded, in the order it sends them."""
    frames: list[dict[str, Any]] = []

    def on_socket(ws: Any) -> None:
        ws.on("framesent", lambda payload: frames.append(json.loads(payload)))

    page.on("websocket", on_socket)
    return frames


def requests_sent(frames: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """The generate/restart frames the page sent; call after the answer's
    ``done`` is in the page, which comes after Playwright's ``framesent``
    events for the request (they are delivered in the order they happened)."""
    sent = [f for f in frames if f["type"] in ("generate", "restart")]
    assert len(sent) == count, sent
    return sent


def wait_answer_done(page: Any) -> None:
    expect(page.locator("#app")).to_have_attribute("data-state", "idle")
    page.wait_for_function("() => window.chat.last()?.done != null")


def test_disclosure_opens_and_values_persist_across_a_reload(
    page: Any, live_server: LiveServer
) -> None:
    open_chat(page, live_server)
    disclosure = page.locator("#sampling")
    expect(disclosure).not_to_have_attribute("open", "")
    expect(page.locator("#repeat-penalty")).to_be_hidden()
    # The summary says the values at a glance while closed.
    expect(page.locator("#sampling-summary")).to_have_text(
        "temperature 0.80 · repeat 1.15/256 · min_p 0.05"
    )

    # Keyboard: the summary is focusable and Enter opens it.
    page.focus("#sampling > summary")
    page.keyboard.press("Enter")
    expect(disclosure).to_have_attribute("open", "")
    expect(page.locator("#repeat-penalty")).to_have_value("1.15")
    expect(page.locator("#repeat-last-n")).to_have_value("256")
    expect(page.locator("#min-p")).to_have_value("0.05")
    expect(page.locator("#json-mode")).not_to_be_checked()
    # The fake engine has no penalties and no min_p: the page says so.
    expect(page.locator("#sampling-note")).to_contain_text("does not honour repeat penalty, min_p")

    page.fill("#temperature", "0.5")
    page.fill("#repeat-penalty", "1.3")
    page.fill("#repeat-last-n", "128")
    page.fill("#min-p", "0.1")
    page.check("#json-mode")
    # Out of range: marked, explained, and the last valid value is kept.
    page.fill("#min-p", "1.5")
    expect(page.locator("#min-p")).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#sampling-note")).to_contain_text("min_p must be a number from 0 to 1")

    page.reload()
    expect(page.locator("#app")).to_have_attribute("data-connection", "open")
    expect(page.locator("#sampling-summary")).to_have_text(
        "temperature 0.50 · repeat 1.3/128 · min_p 0.1 · JSON"
    )
    open_sampling(page)
    expect(page.locator("#temperature")).to_have_value("0.5")
    expect(page.locator("#temperature-value")).to_have_text("0.50")
    expect(page.locator("#repeat-penalty")).to_have_value("1.3")
    expect(page.locator("#repeat-last-n")).to_have_value("128")
    expect(page.locator("#min-p")).to_have_value("0.1")
    expect(page.locator("#json-mode")).to_be_checked()

    page.click("#sampling-reset")
    expect(page.locator("#repeat-penalty")).to_have_value("1.15")
    expect(page.locator("#json-mode")).not_to_be_checked()
    page.reload()
    expect(page.locator("#sampling-summary")).to_have_text(
        "temperature 0.80 · repeat 1.15/256 · min_p 0.05"
    )


def test_generate_and_regenerate_carry_the_chosen_options(
    page: Any, live_server_factory: Any
) -> None:
    server = live_server_factory(backend=HonouringFake)
    frames = record_sent(page)
    open_chat(page, server)
    expect(page.locator("#sampling-note")).to_have_text("")

    # The defaults, to an engine that honours them; min_p 0.05 is the server's own.
    send(page, "List five fruits.")
    wait_answer_done(page)
    [first] = requests_sent(frames, 1)
    assert first["type"] == "generate"
    assert first["temperature"] == 0.8
    assert first["repeat_penalty"] == 1.15 and first["repeat_last_n"] == 256
    assert "min_p" not in first and "json_schema" not in first

    # Chosen values, on Regenerate (a restart overriding them).
    open_sampling(page)
    page.fill("#temperature", "0.3")
    page.fill("#repeat-penalty", "1.25")
    page.fill("#repeat-last-n", "-1")
    page.fill("#min-p", "0")  # off: sent, or the server's 0.05 would apply
    page.check("#json-mode")
    page.click("#regenerate")
    wait_answer_done(page)
    restart = requests_sent(frames, 2)[1]
    assert restart["type"] == "restart" and restart["id"] == first["id"]
    assert restart["temperature"] == 0.3
    assert restart["repeat_penalty"] == 1.25 and restart["repeat_last_n"] == -1
    assert restart["min_p"] == 0
    assert restart["json_schema"] == {"type": "object"}
    assert isinstance(json.loads(page.evaluate("() => window.chat.last().text")), dict)

    # JSON off again: a restart would inherit the schema, so the page asks afresh.
    page.uncheck("#json-mode")
    page.click("#regenerate")
    wait_answer_done(page)
    again = requests_sent(frames, 3)[2]
    assert again["type"] == "generate" and "json_schema" not in again
    assert again["messages"] == first["messages"]
    assert again["repeat_penalty"] == 1.25 and again["min_p"] == 0
    expect(page.locator(".message.assistant")).to_have_count(1)
    expect(page.locator(".message.assistant .meta")).to_contain_text("tokens")


def test_json_switch_yields_a_parseable_object(page: Any, live_server: LiveServer) -> None:
    frames = record_sent(page)
    open_chat(page, live_server)
    open_sampling(page)
    page.check("#json-mode")
    send(page, "Describe a fruit as JSON.")
    wait_answer_done(page)
    [sent] = requests_sent(frames, 1)
    assert sent["json_schema"] == {"type": "object"}
    # The fake engine honours none of the defaults that differ from neutral: left out.
    assert "repeat_penalty" not in sent and "min_p" not in sent
    text = page.evaluate("() => window.chat.last().text")
    assert isinstance(json.loads(text), dict)
    stored = page.evaluate("() => window.chat.store.current.messages.at(-1).content")
    assert json.loads(stored) == json.loads(text)


def test_a_refused_option_is_shown_and_the_page_stays_usable(
    page: Any, live_server: LiveServer
) -> None:
    open_chat(page, live_server)
    open_sampling(page)
    page.fill("#repeat-penalty", "1.3")  # a choice, so sent: the fake engine refuses it
    send(page, "Hello")
    notice = page.locator(".message.assistant .notice")
    expect(notice).to_have_attribute("role", "alert")
    expect(notice).to_contain_text("The server refused an option")
    expect(notice).to_contain_text("'repeat_penalty' is not supported")
    expect(notice).to_contain_text("Change it under Sampling, or Reset it.")
    expect(page.locator("#app")).to_have_attribute("data-state", "idle")
    expect(page.locator("#app")).to_have_attribute("data-connection", "open")

    page.click("#sampling-reset")
    send(page, "Hello again")
    wait_answer_done(page)
    expect(last_answer(page)).not_to_be_empty()
    meta = page.locator(".message.assistant .meta").last
    expect(meta).to_contain_text("tokens")
    expect(meta).not_to_contain_text("Incomplete")
    expect(page.locator(".message.assistant .notice")).to_have_count(1)


def test_screenshot_with_the_sampling_disclosure_open(page: Any, live_server: LiveServer) -> None:
    """For the eye: the open disclosure in the composer (artifacts/)."""
    open_chat(page, live_server)
    send(page, "Hello")
    wait_answer_done(page)
    open_sampling(page)
    page.check("#json-mode")
    page.locator("#app").screenshot(path=str(save_artifact("sampling-open.png")))
    page.locator("#composer").screenshot(path=str(save_artifact("sampling-composer.png")))
