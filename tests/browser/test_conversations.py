"""Conversations on the chat page: history sent as ``messages``, kept in
localStorage across reloads, edit-and-resend, regenerate, new chat; and the
frame ceiling as the page sees it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from .chat import expect, last_answer, last_done, messages_for, open_chat, send, set_options
from .conftest import LiveServer, reference_text

pytestmark = pytest.mark.browser

# Every frame the page sends, recorded before the page's own scripts run.
RECORD_SENT = """
window.__sent = [];
const send = WebSocket.prototype.send;
WebSocket.prototype.send = function (data) {
    window.__sent.push(JSON.parse(data));
    return send.call(this, data);
};
"""


def generates(page: Any) -> list[dict[str, Any]]:
    frames = page.evaluate("() => window.__sent")
    return [f for f in frames if f["type"] == "generate"]


def echo(factory: Any, **overrides: Any) -> LiveServer:
    values = {"backend.fake.echo": True, "backend.fake.tokens_per_s": 0}
    values.update(overrides)
    return factory(**values)  # type: ignore[no-any-return]


def turn(page: Any, text: str) -> None:
    send(page, text)
    last_done(page)
    expect(page.locator("#app")).to_have_attribute("data-state", "idle")


def test_history_is_sent_and_restored_after_a_reload(page: Any, live_server_factory: Any) -> None:
    page.add_init_script(RECORD_SENT)
    open_chat(page, echo(live_server_factory))
    turn(page, "first *question*")
    turn(page, "second question")
    # The second request carried the whole conversation.
    assert generates(page)[-1]["messages"] == [
        {"role": "user", "content": "first *question*"},
        {"role": "assistant", "content": "first *question*"},
        {"role": "user", "content": "second question"},
    ]
    before = page.locator("#log").inner_html()

    page.reload()
    expect(page.locator("#app")).to_have_attribute("data-connection", "open")
    expect(page.locator(".message")).to_have_count(4)
    expect(page.locator(".message.assistant .text em")).to_have_text("question")
    assert page.locator("#log").inner_html() == before
    expect(page.locator("#history li")).to_have_count(1)
    expect(page.locator("#history li .open-chat")).to_have_text("first *question*")

    # The restored conversation goes on where it was.
    turn(page, "third")
    assert [m["content"] for m in generates(page)[-1]["messages"]] == [
        "first *question*",
        "first *question*",
        "second question",
        "second question",
        "third",
    ]


def test_a_reload_mid_answer_shows_the_whole_answer(page: Any, live_server_factory: Any) -> None:
    """The answer is resumable: id, token and last seq survive the reload in
    sessionStorage, and the new page picks the answer up where it was."""
    page.add_init_script(RECORD_SENT)
    server = live_server_factory(**{"backend.fake.tokens_per_s": 100})
    open_chat(page, server)
    set_options(page, max_tokens=300, seed=3)
    send(page, "a long one")
    shown = "() => document.querySelector('.message.assistant .text')?.textContent.length ?? 0"
    page.wait_for_function(f"() => ({shown})() > 100")
    before = page.evaluate(shown)
    page.reload()
    done = last_done(page)
    assert done["reason"] == "length"
    expect(page.locator(".message.assistant .meta")).to_contain_text("300 tokens")
    expect(page.locator(".message.assistant .notice")).to_have_count(0)
    whole = page.locator(".message.assistant .text").text_content() or ""
    assert len(whole) > before
    # The same text as an uninterrupted run, no gap and no duplicate.
    expected, _ = reference_text(
        server, messages=messages_for("a long one"), max_tokens=300, seed=3
    )
    assert " ".join(whole.split()) == " ".join(expected.split())
    stored = page.evaluate("() => window.chat.store.current.messages.at(-1).content")
    assert stored == expected
    # The new page resumed; it never asked for the answer again.
    sent = page.evaluate("() => window.__sent")
    assert [f["type"] for f in sent] == ["resume"]
    expect(page.locator("#app")).to_have_attribute("data-state", "idle")
    assert page.evaluate("() => sessionStorage.getItem('wsserver.resume')") is None


def test_edit_and_resend_replaces_the_last_message_and_its_answer(
    page: Any, live_server_factory: Any
) -> None:
    page.add_init_script(RECORD_SENT)
    open_chat(page, echo(live_server_factory))
    turn(page, "first")
    turn(page, "secnd")
    # Only the last user message can be edited.
    expect(page.locator(".message.user .edit")).to_have_count(1)
    page.locator(".message.user").last.locator(".edit").click()
    expect(page.locator("#prompt")).to_have_value("secnd")
    expect(page.locator("#editing")).to_be_visible()
    expect(page.locator("#send")).to_have_text("Resend")
    page.fill("#prompt", "second")
    page.press("#prompt", "Enter")
    last_done(page)
    expect(page.locator(".message.user .text")).to_have_text(["first", "second"])
    expect(last_answer(page)).to_have_text("second")
    expect(page.locator(".message")).to_have_count(4)
    expect(page.locator("#editing")).to_be_hidden()
    assert generates(page)[-1]["messages"] == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "first"},
        {"role": "user", "content": "second"},
    ]
    page.reload()
    expect(page.locator(".message.user .text")).to_have_text(["first", "second"])

    # Esc (or Cancel) leaves the message as it was.
    page.locator(".message.user").last.locator(".edit").click()
    page.keyboard.press("Escape")
    expect(page.locator("#editing")).to_be_hidden()
    expect(page.locator("#prompt")).to_have_value("")


def test_regenerate_after_a_reload_asks_again_with_the_same_history(
    page: Any, live_server: LiveServer
) -> None:
    page.add_init_script(RECORD_SENT)
    open_chat(page, live_server)
    set_options(page, max_tokens=20, seed=1)
    turn(page, "tell me")
    first = last_answer(page).text_content()
    page.reload()
    expect(page.locator("#regenerate")).to_be_enabled()
    set_options(page, max_tokens=20, seed=2)
    page.click("#regenerate")
    last_done(page)
    expect(page.locator(".message.assistant")).to_have_count(1)
    assert last_answer(page).text_content() != first
    assert generates(page)[-1]["messages"] == [{"role": "user", "content": "tell me"}]
    assert generates(page)[-1]["seed"] == 2
    # The regenerated answer is what is kept.
    regenerated = last_answer(page).text_content()
    page.reload()
    expect(last_answer(page)).to_have_text(regenerated)


def test_new_chat_keeps_the_old_one_listed(page: Any, live_server_factory: Any) -> None:
    open_chat(page, echo(live_server_factory))
    turn(page, "about cats")
    page.click("#new-chat")
    expect(page.locator(".message")).to_have_count(0)
    expect(page.locator("#empty")).to_be_visible()
    expect(page.locator("#regenerate")).to_be_disabled()
    turn(page, "about dogs")
    expect(page.locator("#history .open-chat")).to_have_text(["about dogs", "about cats"])
    page.click("#history li:has-text('about cats') .open-chat")
    expect(page.locator(".message.user .text")).to_have_text(["about cats"])
    page.reload()
    expect(page.locator(".message.user .text")).to_have_text(["about cats"])
    page.click("#history li:has-text('about cats') .delete-chat")
    expect(page.locator("#history .open-chat")).to_have_text(["about dogs"])
    stored = json.loads(page.evaluate("() => localStorage.getItem('wsserver.chat.v1')"))
    assert [c["title"] for c in stored["conversations"]] == ["about dogs"]


def test_the_page_sees_at_most_one_frame_per_window(page: Any, live_server_factory: Any) -> None:
    """An unlimited producer: the page counts delta frames per second of its own
    time. Before the ceiling this was ~700 a second; with flush_ms = 50 it is
    at most 20, plus the first and the last, and a few frames of slack for
    frames that the network or a busy page bunched at the start or the end."""
    flush_ms = 50
    server = live_server_factory(
        **{"backend.fake.tokens_per_s": 0, "stream.flush_ms": flush_ms, "stream.flush_tokens": 1}
    )
    open_chat(page, server)
    page.evaluate(
        """() => {
            const probe = window.__deltas = [];
            window.chat.client.on('frame', (f) => { if (f.type === 'delta') probe.push(performance.now()); });
        }"""
    )
    set_options(page, max_tokens=300_000)
    send(page, "flat out")
    done = last_done(page)
    times = page.evaluate("() => window.__deltas")
    span_ms = times[-1] - times[0]
    assert done["usage"]["completion_tokens"] == 300_000
    assert len(times) >= 3
    assert len(times) <= 2 + span_ms / flush_ms + 3, (len(times), span_ms)


def test_a_long_conversation_drops_its_oldest_messages_to_fit_the_limits(
    page: Any, live_server_factory: Any
) -> None:
    page.add_init_script(RECORD_SENT)
    open_chat(page, echo(live_server_factory, **{"limits.max_prompt_chars": 100}))
    for n in range(4):
        turn(page, f"message number {n} " + "x" * 10)  # 27 characters, echoed back
    sent = generates(page)[-1]["messages"]
    # 100 characters hold three of the 27-character messages; a history must
    # begin with the user, so the oldest answer goes too.
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[-1]["content"].startswith("message number 3")
    assert sum(len(m["content"]) for m in sent) <= 100
    expect(page.locator(".notice")).to_have_count(0)
    expect(page.locator(".message")).to_have_count(8)
