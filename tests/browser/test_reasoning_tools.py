"""The chat page shows a model's reasoning and tool calls.

The fake engine echoes the last user message as the model's output
(``backend.fake.echo``), so a test writes what "the model" says: a think
block, an answer, a Hermes ``<tool_call>``. The server splits and parses it;
the page must show the reasoning in a collapsed "Thinking" block, live while
it streams and sanitized like the answer, and each call as a card — through
a reload mid-answer and after it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from wsserver.backends.fake import FakeBackend

from .chat import expect, last_done, open_chat, send, set_options
from .conftest import LiveServer

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

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
ARGUMENTS = {"city": "Tōkyō", "days": 3}
# Markdown is rendered; raw HTML from the model is shown as text, never run.
HOSTILE = '**Careful** <img src=x onerror="window.__pwned = 1"> with this.'


def script(steps: int) -> tuple[str, str]:
    """What "the model" writes, and the reasoning the page should show."""
    reasoning = " ".join(f"Step {i}: weigh it." for i in range(steps)) + " " + HOSTILE
    call = json.dumps({"name": "get_weather", "arguments": ARGUMENTS}, ensure_ascii=False)
    return f"<think>{reasoning}</think>\n\nLet me check. <tool_call>{call}</tool_call>", reasoning


def echo_server(factory: Any, tokens_per_s: float) -> LiveServer:
    values = {"backend.fake.echo": True, "backend.fake.tokens_per_s": tokens_per_s}
    return factory(**values)  # type: ignore[no-any-return]


def set_tools(page: Any, text: str) -> None:
    set_options(page, max_tokens=4000)  # room for the whole script
    if page.locator("#tools").get_attribute("open") is None:
        page.click("#tools > summary")
    page.fill("#tools-json", text)


def sent(page: Any) -> list[dict[str, Any]]:
    return page.evaluate("() => window.__sent")  # type: ignore[no-any-return]


def words(text: str | None) -> str:
    return " ".join((text or "").split())


def assert_the_finished_answer(page: Any, reasoning: str) -> None:
    article = page.locator(".message.assistant").last
    thinking = article.locator("details.thinking")
    expect(thinking).to_have_attribute("data-state", "done")
    expect(thinking.locator("summary")).to_have_text("Thoughts")
    # Rendered like the answer: markdown, and the model's HTML as text.
    body = thinking.locator(".thinking-text")
    assert words(body.text_content()) == words(reasoning.replace("**", ""))
    expect(body.locator("strong")).to_have_text("Careful")
    expect(body.locator("img")).to_have_count(0)
    assert page.evaluate("() => window.__pwned") is None
    expect(article.locator(".text")).to_have_text("Let me check.")
    card = article.locator(".tool-call")
    expect(card).to_have_count(1)
    expect(card).to_have_attribute("data-state", "ok")
    expect(card.locator(".tool-name")).to_have_text("get_weather")
    expect(card.locator(".tool-id")).to_have_text(page.evaluate(CALL_ID))
    # Pretty-printed as JSON.stringify(…, null, 2) does.
    pretty = json.dumps(ARGUMENTS, indent=2, ensure_ascii=False)
    expect(card.locator(".tool-arguments")).to_have_text(pretty)
    expect(card.locator(".tool-error")).to_have_count(0)


CALL_ID = "() => window.chat.store.current.messages.at(-1).tool_calls[0].id"


def test_reasoning_streams_collapsed_and_the_call_is_a_card(
    page: Any, live_server_factory: Any
) -> None:
    page.add_init_script(RECORD_SENT)
    open_chat(page, echo_server(live_server_factory, tokens_per_s=60))
    set_tools(page, json.dumps(TOOLS))
    expect(page.locator("#tools-summary")).to_have_text("get_weather")
    text, reasoning = script(steps=40)
    send(page, text)

    # While the model thinks: a collapsed block, filling as it streams.
    thinking = page.locator(".message.assistant details.thinking")
    expect(thinking).to_have_attribute("data-state", "streaming")
    expect(thinking.locator("summary")).to_have_text("Thinking…")
    assert thinking.get_attribute("open") is None
    page.wait_for_function(
        "() => document.querySelector('.thinking-text')?.textContent.length > 20"
    )
    assert page.evaluate("() => window.chat.current()?.finished") is False
    expect(page.locator(".message.assistant .tool-call")).to_have_count(0)
    # Opened, it shows the reasoning, and goes on growing.
    page.click(".message.assistant details.thinking > summary")
    expect(thinking.locator(".thinking-text")).to_be_visible()
    shown = len(thinking.locator(".thinking-text").text_content() or "")
    page.wait_for_function(
        "n => document.querySelector('.thinking-text').textContent.length > n", arg=shown
    )

    done = last_done(page)
    assert done["reason"] == "tool_calls"
    assert_the_finished_answer(page, reasoning)
    expect(page.locator(".message.assistant .meta")).to_contain_text("tool calls")
    generate = [f for f in sent(page) if f["type"] == "generate"][-1]
    assert generate["tools"] == TOOLS

    # The next turn carries the call in the history (and not the reasoning).
    send(page, "It is sunny.")
    last_done(page)
    expect(page.locator("#app")).to_have_attribute("data-state", "idle")
    history = [f for f in sent(page) if f["type"] == "generate"][-1]["messages"]
    call_id = page.evaluate("() => window.chat.store.current.messages[1].tool_calls[0].id")
    assert history[1] == {
        "role": "assistant",
        "content": "Let me check. ",
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": "get_weather",
                    # The model's own JSON text (as script() wrote it).
                    "arguments": json.dumps(ARGUMENTS, ensure_ascii=False),
                },
            }
        ],
    }
    # An answer without reasoning or calls gets neither block.
    expect(page.locator(".message.assistant").last.locator("details.thinking")).to_have_count(0)
    expect(page.locator(".message.assistant").last.locator(".tool-call")).to_have_count(0)


def test_a_reload_mid_reasoning_keeps_the_reasoning_and_the_call(
    page: Any, live_server_factory: Any
) -> None:
    page.add_init_script(RECORD_SENT)
    open_chat(page, echo_server(live_server_factory, tokens_per_s=60))
    set_tools(page, json.dumps(TOOLS))
    text, reasoning = script(steps=60)
    send(page, text)
    page.wait_for_function(
        "() => document.querySelector('.thinking-text')?.textContent.length > 40"
    )
    assert page.evaluate("() => window.chat.current()?.finished") is False
    page.reload()

    done = last_done(page)
    assert done["reason"] == "tool_calls"
    # The new page resumed the answer; it never asked for it again.
    assert [f["type"] for f in sent(page)] == ["resume"]
    assert_the_finished_answer(page, reasoning)
    stored = page.evaluate("() => window.chat.store.current.messages.at(-1)")
    assert stored["reasoning"] == reasoning
    assert json.loads(stored["tool_calls"][0]["arguments"]) == ARGUMENTS

    # And after it, from the store: the same blocks, the reasoning collapsed.
    page.reload()
    expect(page.locator("#app")).to_have_attribute("data-connection", "open")
    assert page.locator("details.thinking").get_attribute("open") is None
    assert_the_finished_answer(page, reasoning)
    expect(page.locator("#tools-json")).to_have_value(json.dumps(TOOLS))

    # Regenerate replaces the answer's reasoning and calls, never adds to them.
    set_options(page, max_tokens=4000)  # the field is back at its default after the reload
    page.click("#regenerate")
    assert last_done(page)["reason"] == "tool_calls"
    expect(page.locator("#app")).to_have_attribute("data-state", "idle")
    expect(page.locator(".message.assistant")).to_have_count(1)
    expect(page.locator("details.thinking")).to_have_count(1)
    assert_the_finished_answer(page, reasoning)


def test_a_call_whose_arguments_do_not_parse_is_marked(page: Any, live_server_factory: Any) -> None:
    # The server checks every call it sends; a call cut short (or relayed
    # unchecked) is what the page may still hold. Stored as such, it shows so.
    server = echo_server(live_server_factory, tokens_per_s=0)
    conversation = {
        "version": 1,
        "currentId": "c1",
        "conversations": [
            {
                "id": "c1",
                "title": "weather",
                "updated": 1,
                "messages": [
                    {"role": "user", "content": "weather?"},
                    {
                        "role": "assistant",
                        "content": "",
                        "meta": "Stopped",
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "name": "get_weather",
                                "arguments": '{"city": "Os',
                            }
                        ],
                    },
                ],
            }
        ],
    }
    stored = json.dumps(json.dumps(conversation))
    page.add_init_script(f"localStorage.setItem('wsserver.chat.v1', {stored})")
    open_chat(page, server)
    card = page.locator(".tool-call")
    expect(card).to_have_attribute("data-state", "invalid")
    expect(card.locator(".tool-arguments")).to_have_text('{"city": "Os')
    expect(card.locator(".tool-error")).to_contain_text("not valid JSON")

    # Tools that are not a valid list are said to be invalid, and not sent.
    page.add_init_script(RECORD_SENT)
    page.reload()
    expect(page.locator("#app")).to_have_attribute("data-connection", "open")
    set_tools(page, '[{"type": "function"}]')
    expect(page.locator("#tools-note")).to_contain_text("No tools are sent")
    expect(page.locator("#tools-json")).to_have_attribute("aria-invalid", "true")
    send(page, "plain")
    last_done(page)
    generate = [f for f in sent(page) if f["type"] == "generate"][-1]
    assert "tools" not in generate


class ToollessFake(FakeBackend):
    """The fake engine without tools, as an engine that cannot show them
    to its model declares (``hello.honours`` then lacks ``tools``)."""

    honours = FakeBackend.honours - {"tools"}


def test_an_engine_without_tools_is_said_so_and_its_refusal_shown(
    page: Any, live_server_factory: Any
) -> None:
    open_chat(page, live_server_factory(backend=lambda: ToollessFake(tokens_per_s=0)))
    set_tools(page, json.dumps(TOOLS))
    expect(page.locator("#tools-note")).to_contain_text("does not take tools")
    send(page, "weather?")
    notice = page.locator(".message.assistant .notice")
    expect(notice).to_have_attribute("role", "alert")
    expect(notice).to_contain_text("The server refused the tools")
    expect(notice).to_contain_text("'tools'")
    expect(notice).to_contain_text("Change them under Tools, or empty it.")
    expect(page.locator("#app")).to_have_attribute("data-state", "idle")
    # Emptied, the tools are not sent, and the page answers again.
    page.fill("#tools-json", "")
    expect(page.locator("#tools-summary")).to_have_text("none")
    expect(page.locator("#tools-note")).to_be_empty()
    send(page, "weather again?")
    assert last_done(page)["reason"] == "length"


def test_stop_mid_reasoning_keeps_what_was_thought(page: Any, live_server_factory: Any) -> None:
    open_chat(page, echo_server(live_server_factory, tokens_per_s=60))
    set_tools(page, json.dumps(TOOLS))
    text, _ = script(steps=60)
    send(page, text)
    page.wait_for_function(
        "() => document.querySelector('.thinking-text')?.textContent.length > 20"
    )
    page.click("#stop")
    expect(page.locator("#app")).to_have_attribute("data-state", "idle")
    thinking = page.locator("details.thinking")
    expect(thinking).to_have_attribute("data-state", "done")
    # "Stopped" at once, then the done's figures ending in "stopped".
    expect(page.locator(".message.assistant .meta")).to_have_text(re.compile("stopped$", re.I))
    expect(page.locator(".tool-call")).to_have_count(0)
    assert last_done(page)["reason"] == "cancelled"
    stored = page.evaluate("() => window.chat.store.current.messages.at(-1)")
    shown = thinking.locator(".thinking-text").text_content() or ""
    assert stored["reasoning"] and words(stored["reasoning"]) == words(shown)
    assert "tool_calls" not in stored
