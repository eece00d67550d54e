"""An assistant message's reasoning in the conversation (sans-I/O): the
WebSocket ``messages[].reasoning``, OpenAI's ``reasoning_content`` and
Anthropic's ``thinking`` blocks of the tool-use loop in progress (earlier
turns' dropped) land on the core's :class:`~wsserver.chat_input.Message`; templates and upstreams get it as
``reasoning_content`` (llama.cpp's name), the plain-text fallback leaves it out.

The llama engine's rendering and count of it are in
tests/test_llama_template.py and tests/test_anthropic_llama.py."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from conftest import CLIENT_FRAME

from wsserver.anthropic_api import parse_body as anthropic_body
from wsserver.anthropic_api import to_generate as anthropic_generate
from wsserver.api_errors import ApiError
from wsserver.backends.base import GenerationRequest
from wsserver.backends.openai_wire import request_body
from wsserver.errors import ProtocolError
from wsserver.openai_api import parse_request
from wsserver.protocol import Generate, Limits, Message, ToolCall, parse_client_frame

CALL = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"path":"."}'}}
LS = ToolCall("c1", "ls", '{"path":"."}')


def generate(limits: Limits | None = None, **fields: Any) -> Generate:
    obj = {"type": "generate", "id": "g", **fields}
    frame = parse_client_frame(json.dumps(obj), limits or Limits())
    assert isinstance(frame, Generate)
    CLIENT_FRAME.validate(obj)  # what the server takes, the schema says it takes
    return frame


# ---------------------------------------------------------------- the protocol


def test_an_assistant_messages_reasoning_is_kept_and_goes_on_as_reasoning_content() -> None:
    frame = generate(
        messages=[
            {"role": "user", "content": "Fix the bug"},
            {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning": "Look."},
            {"role": "tool", "tool_call_id": "c1", "content": "main.py"},
        ]
    )
    assert frame.messages is not None
    assistant = frame.messages[1]
    assert assistant == Message("assistant", "", (LS,), reasoning="Look.")
    # Templates and upstreams read llama.cpp's name; the frame's own is `reasoning`.
    assert assistant.to_openai() == {
        "role": "assistant",
        "content": None,
        "tool_calls": [CALL],
        "reasoning_content": "Look.",
    }
    assert assistant.to_frame()["reasoning"] == "Look."
    assert "reasoning_content" not in frame.messages[0].to_openai()
    # Empty reasoning is none (a template would show an empty think block).
    empty = generate(messages=[{"role": "assistant", "content": "a", "reasoning": ""}])
    assert empty.messages is not None and empty.messages[0].reasoning is None


@pytest.mark.parametrize(
    ("message", "words"),
    [
        ({"role": "user", "content": "x", "reasoning": "r"}, "messages[0].reasoning: only an"),
        ({"role": "tool", "content": "x", "tool_call_id": "c", "reasoning": "r"}, "only an"),
        ({"role": "assistant", "content": "x", "reasoning": ["r"]}, "must be a string"),
    ],
)
def test_reasoning_elsewhere_or_not_text_is_a_bad_request(
    message: dict[str, Any], words: str
) -> None:
    with pytest.raises(ProtocolError) as caught:
        generate(messages=[message])
    assert caught.value.code == "bad_request" and words in str(caught.value)
    frame = {"type": "generate", "id": "g", "messages": [message]}
    assert not CLIENT_FRAME.is_valid(frame)  # the schema refuses it too


def test_reasoning_counts_against_the_prompt_limit() -> None:
    limits = Limits(max_prompt_chars=20)
    message = {"role": "assistant", "content": "0123456789", "reasoning": "r" * 9}
    generate(limits, messages=[message])  # 19 characters: within
    with pytest.raises(ProtocolError) as caught:
        generate(limits, messages=[{**message, "reasoning": "r" * 11}])
    assert caught.value.code == "too_large"


def test_the_relay_sends_reasoning_content_upstream() -> None:
    frame = generate(
        messages=[
            {"role": "user", "content": "Fix the bug"},
            {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning": "Look."},
            {"role": "tool", "tool_call_id": "c1", "content": "main.py"},
        ]
    )
    _, body = request_body(GenerationRequest.from_frame(frame, default_max_tokens=8), "m")
    assert orjson.loads(body)["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [CALL],
        "reasoning_content": "Look.",
    }


# ---------------------------------------------------------------- OpenAI chat


def openai_messages(*messages: dict[str, Any]) -> tuple[Message, ...]:
    body = orjson.dumps({"model": "m", "messages": list(messages)})
    generated = parse_request("chat", body, "r", Limits()).generate.messages
    assert generated is not None
    return generated


def test_the_openai_api_takes_reasoning_content_on_an_assistant_message() -> None:
    messages = openai_messages(
        {"role": "user", "content": "Fix the bug"},
        {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "Look."},
        {"role": "tool", "tool_call_id": "c1", "content": "main.py"},
    )
    assert messages[1] == Message("assistant", "", (LS,), reasoning="Look.")
    # null is "not given", as everywhere in OpenAI's API.
    (plain,) = openai_messages({"role": "assistant", "content": "a", "reasoning_content": None})
    assert plain.reasoning is None


@pytest.mark.parametrize(
    ("message", "words"),
    [
        (
            {"role": "user", "content": "x", "reasoning_content": "r"},
            "messages[0].reasoning_content: only an assistant message carries reasoning",
        ),
        (
            {"role": "assistant", "content": "x", "reasoning_content": 3},
            "messages[0].reasoning_content must be a string",
        ),
    ],
)
def test_the_openai_api_names_reasoning_content_when_refusing_it(
    message: dict[str, Any], words: str
) -> None:
    with pytest.raises(ApiError) as caught:
        openai_messages(message)
    assert caught.value.status == 400 and caught.value.param == "messages"
    assert words in caught.value.message


# ---------------------------------------------------------------- Anthropic


def anthropic_messages(messages: list[dict[str, Any]]) -> tuple[Message, ...]:
    body = {"model": "m", "max_tokens": 50, "messages": messages}
    generated = anthropic_generate(anthropic_body(body), "r", Limits()).messages
    assert generated is not None
    return generated


def thinking(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": "sig"}


def tool_use(call_id: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": "ls", "input": {"path": "."}}


def tool_result(call_id: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": call_id, "content": "main.py"}


def test_anthropic_keeps_the_thinking_of_the_tool_use_loop_in_progress() -> None:
    messages = anthropic_messages(
        [
            {"role": "user", "content": "Fix the bug"},
            {"role": "assistant", "content": [thinking("First, the layout."), tool_use("c1")]},
            {"role": "user", "content": [tool_result("c1")]},
            # Interleaved thinking: two blocks in one turn, joined.
            {
                "role": "assistant",
                "content": [
                    thinking("Now main.py."),
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Reading."},
                    thinking("And its test."),
                    tool_use("c2"),
                ],
            },
            {"role": "user", "content": [tool_result("c2")]},
        ]
    )
    assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant", "tool"]
    assert messages[1].reasoning == "First, the layout."
    assert messages[3].reasoning == "Now main.py.\n\nAnd its test."  # redacted: dropped
    assert messages[3].content == "Reading."
    # To the engine it is the frame's `reasoning`, to templates `reasoning_content`.
    assert messages[1].to_openai()["reasoning_content"] == "First, the layout."


def test_anthropic_drops_the_thinking_of_turns_before_the_last_user_text() -> None:
    earlier = [
        {"role": "user", "content": "Fix the bug"},
        {"role": "assistant", "content": [thinking("Old loop."), tool_use("c1")]},
        {"role": "user", "content": [tool_result("c1")]},
        {
            "role": "assistant",
            "content": [thinking("Old answer."), {"type": "text", "text": "Done."}],
        },
    ]
    # A new question: every turn before it is an earlier turn.
    messages = anthropic_messages([*earlier, {"role": "user", "content": "Thanks. Now?"}])
    assert all(m.reasoning is None for m in messages)
    # Tool results with text also start a new turn (the user said something).
    with_text = anthropic_messages(
        [
            {"role": "user", "content": "Fix the bug"},
            {"role": "assistant", "content": [thinking("Loop."), tool_use("c1")]},
            {"role": "user", "content": [tool_result("c1"), {"type": "text", "text": "Also X."}]},
        ]
    )
    assert all(m.reasoning is None for m in with_text)
    # The new turn's own loop keeps its thinking, the earlier ones' stays out.
    loop = anthropic_messages(
        [
            *earlier,
            {"role": "user", "content": "Now the other bug"},
            {"role": "assistant", "content": [thinking("New loop."), tool_use("c9")]},
            {"role": "user", "content": [tool_result("c9")]},
        ]
    )
    assert [m.reasoning for m in loop if m.role == "assistant"] == [None, None, "New loop."]


def test_anthropic_reasoning_counts_against_the_prompt_limit() -> None:
    body = {
        "model": "m",
        "max_tokens": 50,
        "messages": [
            {"role": "user", "content": "Fix"},
            {"role": "assistant", "content": [thinking("t" * 40), tool_use("c1")]},
            {"role": "user", "content": [tool_result("c1")]},
        ],
    }
    # 24 characters of text, call and result, and 40 of thinking.
    anthropic_generate(anthropic_body(body), "r", Limits(max_prompt_chars=64))
    with pytest.raises(ApiError) as caught:
        anthropic_generate(anthropic_body(body), "r", Limits(max_prompt_chars=63))
    assert caught.value.status == 413 and "exceed 63 characters" in caught.value.message


# ---------------------------------------------------------------- rendering


def test_the_plain_text_fallback_leaves_reasoning_out() -> None:
    llama = pytest.importorskip("wsserver.backends.llama")
    with_reasoning = (
        Message("user", "Fix the bug"),
        Message("assistant", "", (LS,), reasoning="Look."),
        Message("tool", "main.py", tool_call_id="c1"),
    )
    without = (with_reasoning[0], Message("assistant", "", (LS,)), with_reasoning[2])
    prompt = llama.plain_chat_prompt(with_reasoning)
    assert prompt == llama.plain_chat_prompt(without) and "Look." not in prompt
