"""An assistant message's reasoning in the conversation (sans-I/O): the
WebSocket ``messages[].reasoning``, OpenAI's ``reasoning_content``,
Anthropic's ``thinking`` blocks of the tool-use loop in progress (earlier
turns' dropped) and the Responses API's ``reasoning`` items all land on the
core's :class:`~wsserver.core.chat_input.Message`; templates and upstreams get it as
``reasoning_content`` (llama.cpp's name), the plain-text fallback leaves it out.

The llama engine's rendering and count of it are in
tests/test_llama_template.py and tests/test_anthropic_llama.py."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import orjson
import pytest
from conftest import CLIENT_FRAME

from wsserver.backends.base import GenerationRequest
from wsserver.backends.openai_wire import request_body
from wsserver.core.protocol import (
    CallPart,
    Done,
    Generate,
    Limits,
    Message,
    Timings,
    ToolCall,
    Usage,
    parse_client_frame,
)
from wsserver.dialects.anthropic.api import parse_body as anthropic_body
from wsserver.dialects.anthropic.api import to_generate as anthropic_generate
from wsserver.dialects.api_errors import ApiError
from wsserver.dialects.openai.api import parse_request
from wsserver.dialects.responses.api import ResponsesRequest
from wsserver.dialects.responses.api import parse_body as responses_body
from wsserver.dialects.responses.api import to_generate as responses_generate
from wsserver.dialects.responses.render import ResponseRender
from wsserver.errors import ProtocolError

CALL = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"path":"."}'}}
LS = ToolCall("c1", "ls", '{"path":"."}')
#: A tool-use loop in progress: the assistant's call carries its reasoning.
LOOP = [
    {"role": "user", "content": "Fix the bug"},
    {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning": "Look."},
    {"role": "tool", "tool_call_id": "c1", "content": "main.py"},
]


def generate(limits: Limits | None = None, **fields: Any) -> Generate:
    obj = {"type": "generate", "id": "g", **fields}
    frame = parse_client_frame(json.dumps(obj), limits or Limits())
    assert isinstance(frame, Generate)
    CLIENT_FRAME.validate(obj)  # what the server takes, the schema says it takes
    return frame


# ---------------------------------------------------------------- the protocol


def test_an_assistant_messages_reasoning_is_kept_and_goes_on_as_reasoning_content() -> None:
    frame = generate(messages=LOOP)
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
    frame = generate(messages=LOOP)
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
    # vLLM's and OpenRouter's name for it is honoured too (never ignored).
    (other,) = openai_messages({"role": "assistant", "content": "a", "reasoning": "Look."})
    assert other.reasoning == "Look."


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
        (
            {"role": "user", "content": "x", "reasoning": "r"},
            "messages[0].reasoning: only an assistant message carries reasoning",
        ),
        (
            {"role": "assistant", "content": "x", "reasoning": "a", "reasoning_content": "b"},
            "messages[0]: reasoning_content and reasoning differ",
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


# ---------------------------------------------------------------- Responses


def responses_messages(items: list[dict[str, Any]]) -> tuple[Message, ...]:
    generated = responses_generate(responses_body({"input": items}), (), "r", Limits()).messages
    assert generated is not None
    return generated


def reasoning_item(text: str, *, summary: str = "") -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": summary}] if summary else [],
        "content": [{"type": "reasoning_text", "text": text}] if text else [],
    }


def function_call(call_id: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "ls", "arguments": "{}"}


def test_responses_reasoning_items_attach_to_the_assistant_message_after_them() -> None:
    messages = responses_messages(
        [
            {"role": "user", "content": "Fix the bug"},
            reasoning_item("First, the layout."),
            function_call("c1"),
            {"type": "function_call_output", "call_id": "c1", "output": "main.py"},
            # Only a summary: the summary is the text.
            reasoning_item("", summary="Reading main.py."),
            {"role": "assistant", "content": [{"type": "output_text", "text": "Reading."}]},
            reasoning_item("Then its test."),
            function_call("c2"),
            {"type": "function_call_output", "call_id": "c2", "output": "ok"},
        ]
    )
    assert [(m.role, m.reasoning) for m in messages] == [
        ("user", None),
        ("assistant", "First, the layout."),
        ("tool", None),
        ("assistant", "Reading main.py.\n\nThen its test."),  # one message: text, then a call
        ("tool", None),
    ]
    assert [c.id for c in messages[3].tool_calls] == ["c2"]


def test_responses_reasoning_that_no_assistant_item_follows_is_dropped() -> None:
    messages = responses_messages(
        [
            {"role": "user", "content": "a"},
            reasoning_item("lost"),
            {"role": "user", "content": "b"},
            reasoning_item("", summary=""),
        ]
    )
    assert all(m.reasoning is None for m in messages)


def test_a_previous_response_keeps_its_reasoning_only_while_the_loop_goes_on() -> None:
    request = ResponsesRequest(input=({"role": "user", "content": "q"},))
    done = Done(
        id="r",
        reason="stop",
        usage=Usage(prompt_tokens=3, completion_tokens=2),
        timings=Timings(queued_ms=0.0, ttft_ms=1.0, total_ms=2.0, tokens_per_s=1.0),
    )
    calling = ResponseRender(request, response_id="resp_a", model="m")
    calling.delta("", reasoning="Call ls.")
    calling.delta("", tool_calls=(CallPart(0, "{}", "c1", "ls"),))
    calling.end(dataclasses.replace(done, reason="tool_calls"))
    # Its function_call_output comes next: the loop goes on, with its reasoning.
    assert calling.conversation(())[-1]["reasoning"] == "Call ls."
    answering = ResponseRender(request, response_id="resp_b", model="m")
    answering.delta("", reasoning="Easy.")
    answering.delta("Done.")
    answering.end(done)
    # An answer ends the turn: templates would drop its reasoning, so it is not kept.
    assert answering.conversation(())[-1] == {"role": "assistant", "content": "Done."}


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ({"type": "reasoning", "summary": "x"}, "input[0].summary must be a list"),
        (
            {"type": "reasoning", "summary": [], "content": [{"type": "output_text", "text": "x"}]},
            "input[0].content[0] must be {'type': 'reasoning_text'",
        ),
        (
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": 1}]},
            "input[0].summary[0] must be",
        ),
    ],
)
def test_responses_bad_reasoning_items_are_refused_naming_them(
    item: dict[str, Any], words: str
) -> None:
    with pytest.raises(ApiError) as caught:
        responses_body({"input": [item]})
    assert caught.value.status == 400 and words in caught.value.message


# ---------------------------------------------------------------- rendering


def test_the_plain_text_fallback_leaves_reasoning_out() -> None:
    llama = pytest.importorskip("wsserver.backends.llama_chat")
    with_reasoning = (
        Message("user", "Fix the bug"),
        Message("assistant", "", (LS,), reasoning="Look."),
        Message("tool", "main.py", tool_call_id="c1"),
    )
    without = (with_reasoning[0], Message("assistant", "", (LS,)), with_reasoning[2])
    prompt = llama.plain_chat_prompt(with_reasoning)
    assert prompt == llama.plain_chat_prompt(without) and "Look." not in prompt
