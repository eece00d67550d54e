"""Tool-call parsing (wsserver/tool_calls.py), sans-I/O.

Each syntax's output, cut at every byte position (through the text
assembler, so a marker and a character both arrive in pieces), gives exactly
the content and the calls; malformed calls are errors, never calls.
"""

from __future__ import annotations

import itertools
import json

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wsserver.backends.llama_template import ChatTemplate
from wsserver.core.chat_input import Message, ToolCall
from wsserver.core.textstream import TextAssembler
from wsserver.errors import BackendError
from wsserver.shaping.tool_calls import (
    FRAGMENT_CHARS,
    CallPart,
    Syntax,
    detect_syntax,
    parser_for,
)

NAMES = frozenset({"get_weather", "add"})


def ids() -> itertools.count[int]:
    return itertools.count()


def run(
    syntax: Syntax, data: bytes, cuts: list[int], *, cut: bool = False, **options: object
) -> tuple[str, list[tuple[str, str, str]], list[str]]:
    """Feed ``data`` cut at ``cuts``; content, (id, name, arguments) per call,
    errors. ``cut``: the output ends as cut off by ``max_tokens``."""
    counter = ids()
    assembler = TextAssembler()
    parser = parser_for(
        syntax,
        names=NAMES,
        new_id=lambda: f"call_{next(counter)}",
        **options,  # type: ignore[arg-type]
    )
    content: list[str] = []
    parts: list[CallPart] = []
    errors: list[str] = []
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    splits = [parser.feed(assembler.feed(piece)) for piece in pieces]
    splits += [parser.feed(assembler.flush()), parser.flush(cut=cut)]
    for split in splits:
        content.append(split.content)
        parts.extend(split.calls)
        if split.error:
            errors.append(split.error)
    calls: dict[int, list[str]] = {}
    for part in parts:
        if part.index not in calls:
            assert part.id is not None and part.name is not None  # id and name first
            calls[part.index] = [part.id, part.name, ""]
        else:
            assert part.id is None and part.name is None
        calls[part.index][2] += part.arguments
    assert sorted(calls) == list(range(len(calls)))
    return "".join(content), [(c[0], c[1], c[2]) for c in calls.values()], errors


#: A call's arguments are the model's own JSON text, as it wrote them.
WEATHER = '{"city": "Paris", "unit": "°C"}'

CASES: list[tuple[Syntax, str, str, list[tuple[str, str, str]]]] = [
    (
        "hermes",
        'Let me look 日本. <tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "unit": "°C"}}\n</tool_call>\n<tool_call>{"name": "add", '
        '"arguments": {"a": 1, "b": "}</tool_call>"}}</tool_call>',
        "Let me look 日本. ",
        [
            ("call_0", "get_weather", WEATHER),
            ("call_1", "add", '{"a": 1, "b": "}</tool_call>"}'),
        ],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}',
        "",
        [("call_0", "get_weather", WEATHER)],
    ),
    (
        "llama3",
        ' \n{"type": "function", "name": "add", "parameters": {"a": 1}}; '
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}',
        "",
        [("call_0", "add", '{"a": 1}'), ("call_1", "get_weather", WEATHER)],
    ),
    (
        "mistral",
        'Sure [x] 😀[TOOL_CALLS] [{"id": "abc123XYZ", "name": "get_weather", "arguments": '
        '{"city": "Paris", "unit": "°C"}}, {"name": "add", "arguments": "{\\"a\\": 2}"}]',
        "Sure [x] 😀",
        # The id the model gives before the name is the call's; arguments
        # written as a JSON string go out whole once the call ends, as JSON.
        [("abc123XYZ", "get_weather", WEATHER), ("call_0", "add", '{"a":2}')],
    ),
    (
        # An id after the name comes too late for the call's first part.
        "mistral",
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "abc123XYZ"}]',
        "",
        [("call_0", "add", '{"a": 1}')],
    ),
    (
        # Arguments before the name wait for it, then go out at once.
        "hermes",
        '<tool_call>{"arguments": {"a": [1, "x"]}, "name": "add"}</tool_call>',
        "",
        [("call_0", "add", '{"a": [1, "x"]}')],
    ),
    (
        "generic",
        '{"tool_calls": [{"name": "add", "arguments": {"a": [1, {"b": "]}"}]}}]}',
        "",
        [("call_0", "add", '{"a": [1, {"b": "]}"}]}')],
    ),
    ("generic", '{"response": "Just text é"}', "Just text é", []),
    ("generic", '{"tool_call": {"name": "add", "arguments": {}}}', "", [("call_0", "add", "{}")]),
    (
        "any",
        'Hm <tool_call>{"name": "add", "arguments": {}}</tool_call>',
        "Hm ",
        [
            ("call_0", "add", "{}"),
        ],
    ),
    ("any", 'ok [TOOL_CALLS][{"name": "add", "arguments": {}}]', "ok ", [("call_0", "add", "{}")]),
    (
        "hermes",
        "No call here <tool but text <tool_cal",
        "No call here <tool but text <tool_cal",
        [],
    ),
    ("llama3", '{"answer": 42} is JSON', '{"answer": 42} is JSON', []),
    ("llama3", "  plain { text }", "  plain { text }", []),
]


@pytest.mark.parametrize(("syntax", "text", "content", "calls"), CASES)
def test_every_split_position(
    syntax: Syntax, text: str, content: str, calls: list[tuple[str, str, str]]
) -> None:
    data = text.encode()
    assert run(syntax, data, []) == (content, calls, [])
    for cut in range(1, len(data)):
        assert run(syntax, data, [cut]) == (content, calls, []), cut
    # Byte by byte: every marker, every character arrives in pieces.
    assert run(syntax, data, list(range(1, len(data)))) == (content, calls, [])


def test_content_is_released_as_it_comes_and_markers_are_held() -> None:
    parser = parser_for("hermes", names=NAMES)
    assert parser.feed("Hello <tool_c").content == "Hello "
    assert parser.feed("all>{").content == ""  # inside a call: not content
    split = parser.feed('"name": "add", "arguments": {"a": 1}}</tool_call>')
    assert split.calls[0].name == "add" and split.calls[0].arguments == '{"a": 1}'
    assert split.calls[0].id is not None and split.calls[0].id.startswith("call_")


@pytest.mark.parametrize(
    ("syntax", "text", "error"),
    [
        ("hermes", '<tool_call>{"name": "add", "arguments": {a: 1}}</tool_call>', "not valid JSON"),
        ("hermes", '<tool_call>{"name": "add", "arguments": "a=1"}</tool_call>', "not valid JSON"),
        ("hermes", '<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "not a JSON object"),
        ("hermes", '<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "'rm', which is not"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>', "names no function"),
        ("hermes", '<tool_call>{"name": "add", "argu', "cut off"),
        ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}', "cut off"),
        ("llama3", '{"name": "add", "parameters": {"a": }}', "not valid JSON"),
    ],
)
def test_malformed_calls_are_errors_at_every_split(syntax: Syntax, text: str, error: str) -> None:
    data = text.encode()
    for cut in range(1, len(data)):
        _, calls, errors = run(syntax, data, [cut])
        assert len(errors) == 1 and error in errors[0], (cut, errors)
        # What went out before the error is the call's start, as the model wrote it.
        assert all(name == "add" and arguments in text for _, name, arguments in calls), calls


@pytest.mark.parametrize(
    ("syntax", "text", "content", "calls"),
    [
        # Cut inside the arguments: the call as far as it got.
        (
            "hermes",
            'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
            "Hi ",
            [("call_0", "get_weather", '{"city": "Par')],
        ),
        # Cut before the arguments: the name alone.
        ("hermes", '<tool_call>{"name": "add", "argu', "", [("call_0", "add", "")]),
        # Cut before the name is whole: nothing to release (and no error).
        ("hermes", '<tool_call>{"name": "ad', "", []),
        # The generic envelope, one call and several; whole calls stay checked.
        (
            "generic",
            '{"tool_call": {"name": "add", "arguments": {"a": 1, "b"',
            "",
            [("call_0", "add", '{"a": 1, "b"')],
        ),
        (
            "generic",
            '{"tool_calls": [{"name": "add", "arguments": {"a": 1}}, '
            '{"name": "get_weather", "arguments": {"ci',
            "",
            [("call_0", "add", '{"a": 1}'), ("call_1", "get_weather", '{"ci')],
        ),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}',
            "",
            [("call_0", "add", '{"a": 1}')],
        ),
        (
            "llama3",
            '{"name": "add", "parameters": {"a": [1, ',
            "",
            [("call_0", "add", '{"a": [1, ')],
        ),
    ],
)
def test_a_call_cut_by_max_tokens_is_released_as_far_as_it_got(
    syntax: Syntax, text: str, content: str, calls: list[tuple[str, str, str]]
) -> None:
    data = text.encode()
    for position in range(1, len(data)):
        assert run(syntax, data, [position], cut=True) == (content, calls, []), position
    # The same text ended by the model itself is a malformed call.
    if calls and "arguments" in text:
        assert run(syntax, data, [])[2], text


def test_a_cut_call_to_an_unknown_function_is_still_an_error() -> None:
    data = b'<tool_call>{"name": "rm", "arguments": {"pa'
    _, calls, errors = run("hermes", data, [], cut=True)
    assert calls == [] and len(errors) == 1 and "'rm', which is not" in errors[0]


def test_a_call_without_its_closing_tag_is_whole() -> None:
    assert run("hermes", b'<tool_call>{"name": "add", "arguments": {}}', []) == (
        "",
        [("call_0", "add", "{}")],
        [],
    )


def test_one_call_when_parallel_calls_are_off() -> None:
    text = '<tool_call>{"name": "add"}</tool_call><tool_call>{"name": "add"}</tool_call> x'
    assert run("hermes", text.encode(), [], parallel=False) == ("", [("call_0", "add", "{}")], [])


def test_long_arguments_come_in_bounded_fragments() -> None:
    value = "é" * (FRAGMENT_CHARS * 2 + 5)
    text = '<tool_call>{"name": "add", "arguments": {"a": "' + value + '"}}</tool_call>'
    parser = parser_for("hermes", names=NAMES)
    parts = parser.feed(text).calls
    assert len(parts) == 3 and all(len(p.arguments) <= FRAGMENT_CHARS for p in parts)
    assert orjson.loads("".join(p.arguments for p in parts)) == {"a": value}


def test_the_syntax_is_read_from_the_template() -> None:
    assert detect_syntax(None) == "any"
    assert detect_syntax("{{ '<tool_call>' }}{{ tools | tojson }}") == "hermes"
    assert detect_syntax("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]") == "mistral"
    assert detect_syntax("<|start_header_id|>ipython<|end_header_id|>") == "llama3"
    assert detect_syntax("{{ '<|python_tag|>' }}") == "llama3"
    assert detect_syntax("{% for m in messages %}{{ m.content }}{% endfor %}") == "generic"
    with pytest.raises(ValueError, match="unknown tool call syntax"):
        parser_for("xml")  # type: ignore[arg-type]


RESPONSE = '  {"response": "Hi \\u00e9 \\ud83d\\ude00 \\"q\\" 日本\\n"}'


@pytest.mark.parametrize("syntax", ["generic", "any", "llama3"])
def test_a_generic_answer_streams_as_its_string_comes(syntax: Syntax) -> None:
    decoded = 'Hi é 😀 "q" 日本\n'
    data = RESPONSE.encode()
    for cut in range(1, len(data)):
        assert run(syntax, data, [cut]) == (decoded, [], []), cut
    # Fed a byte at a time: the answer comes out as it is written, not at the end.
    parser = parser_for(syntax, names=NAMES)
    assembler = TextAssembler()
    seen: list[str] = []
    for position in range(len(data)):
        seen.append(parser.feed(assembler.feed(data[position : position + 1])).content)
    seen.append(parser.feed(assembler.flush()).content + parser.flush().content)
    assert "".join(seen) == decoded
    assert sum(1 for piece in seen if piece) > 10
    assert seen[-1] == "" and seen[-2] == ""  # nothing waited for the closing brace
    # Cut off inside the string: what came is the answer, no error.
    half = RESPONSE[: RESPONSE.index("日")].encode()
    assert run(syntax, half, [], cut=True) == ('Hi é 😀 "q" ', [], [])


def test_what_follows_a_generic_answer_is_text() -> None:
    assert run("generic", b'{"response": "a", "x": 1}', [])[0] == 'a, "x": 1}'


#: Calls whose arguments (an object, after the name) stream as they are written:
#: (name, arguments), or (the model's id, name, arguments).
STREAMED: list[tuple[Syntax, str, list[tuple[str, ...]]]] = [
    (
        "hermes",
        'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n'
        '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": "}</tool_call>"}}'
        "</tool_call>",
        [("get_weather", WEATHER), ("add", '{"a": 1, "b": "}</tool_call>"}')],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}; '
        '{"type": "function", "name": "add", "parameters": {"a": [1, {"b": "\\"]}"}]}}',
        [("get_weather", WEATHER), ("add", '{"a": [1, {"b": "\\"]}"}]}')],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "abc123XYZ"}, '
        '{"id": "def456UVW", "name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}]',
        [("add", '{"a": 1}'), ("def456UVW", "get_weather", WEATHER)],
    ),
    (
        "generic",
        '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}}',
        [("get_weather", WEATHER)],
    ),
    (
        "generic",
        '{"tool_calls": [{"name": "add", "arguments": {"a": {"b": [true, null, -1.5e3]}}}, '
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}]}',
        [("add", '{"a": {"b": [true, null, -1.5e3]}}'), ("get_weather", WEATHER)],
    ),
    (
        "any",
        'ok [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}]',
        [("get_weather", WEATHER)],
    ),
]


@pytest.mark.parametrize(("syntax", "text", "calls"), STREAMED)
def test_a_models_call_streams_as_its_json_comes(
    syntax: Syntax, text: str, calls: list[tuple[str, ...]]
) -> None:
    """Fed a byte at a time, each call's first part (id, name) goes out once
    its name is read — before its arguments are complete — and its arguments
    follow in many fragments that join to exactly the model's JSON text."""
    parser = parser_for(syntax, names=NAMES)
    assembler = TextAssembler()
    data = text.encode()
    feeds: list[tuple[CallPart, ...]] = []
    for position in range(len(data)):
        split = parser.feed(assembler.feed(data[position : position + 1]))
        assert split.error is None
        feeds.append(split.calls)
    feeds.append(parser.feed(assembler.flush()).calls + parser.flush().calls)
    assert feeds[-1] == ()  # nothing waited for the end
    for index, call in enumerate(calls):
        *given, name, arguments = call
        at = [
            (feed, part)
            for feed, parts in enumerate(feeds)
            for part in parts
            if part.index == index
        ]
        first_feed, first = at[0]
        assert first.name == name and first.id is not None
        fresh = len(first.id) == 9 if syntax == "mistral" else first.id.startswith("call_")
        assert first.id == given[0] if given else fresh
        assert all(part.name is None and part.id is None for _, part in at[1:])
        assert "".join(part.arguments for _, part in at) == arguments
        fragments = [feed for feed, part in at if part.arguments]
        assert len(fragments) > len(arguments) // 2  # a byte or so at a time
        assert first_feed < fragments[-1]  # the name went out before the arguments ended
        assert orjson.loads(arguments) == orjson.loads("".join(p.arguments for _, p in at))
    assert parser.calls_made == len(calls)


def test_arguments_before_the_name_wait_for_it() -> None:
    parser = parser_for("hermes", names=NAMES)
    assert parser.feed('<tool_call>{"arguments": {"a": 1}, ').calls == ()
    split = parser.feed('"name": "ad')
    assert split.calls == () and split.error is None
    parts = parser.feed('d", "id": "x"}</tool_call>').calls
    assert [(p.index, p.name, p.arguments) for p in parts] == [(0, "add", '{"a": 1}')]
    assert parts[0].id is not None and parts[0].id != "x"  # the id came after the name


def test_past_the_one_call_asked_for_nothing_streams() -> None:
    text = (
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, '
        '{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    )
    data = text.encode()
    for cut in range(1, len(data)):
        assert run("mistral", data, [cut], parallel=False) == (
            "",
            [("call_0", "add", '{"a": 1}')],
            [],
        )


def test_a_call_after_a_generic_answer_is_read_afresh() -> None:
    text = '{"response": "Hi"} then <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    data = text.encode()
    for cut in range(1, len(data)):
        assert run("any", data, [cut]) == ("Hi then ", [("call_0", "add", '{"a": 1}')], []), cut


#: The id check of Mistral's own templates (Mistral 7B v0.3, Nemo), with what
#: they write of a call and its result.
MISTRAL_TEMPLATE = """{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}[TOOL_CALLS][
{%- for call in message.tool_calls %}
{%- if not call.id is defined or call.id is not string or call.id|length != 9 %}
{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
{%- endif %}
{{- {"name": call.function.name, "arguments": call.function.arguments, "id": call.id}|tojson }}
{%- endfor %}]</s>
{%- elif message.role == "tool" %}[TOOL_RESULTS]{"call_id": "{{ message.tool_call_id }}"}
{%- else %}[INST]{{ message.content }}[/INST]{% endif %}
{%- endfor %}"""


def test_mistral_calls_get_ids_its_template_takes_back() -> None:
    """A streamed call cannot wait for the id Mistral writes after the
    arguments: the fresh id is in Mistral's shape, so that the call and its
    result render in the next turn's prompt."""
    parser = parser_for("mistral", names=NAMES)
    text = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "abc123XYZ"}]'
    parts = parser.feed(text).calls + parser.flush().calls
    call_id = parts[0].id
    assert call_id is not None and len(call_id) == 9 and call_id.isalnum()
    history = [
        Message("user", "add"),
        Message("assistant", "", (ToolCall(call_id, "add", parts[0].arguments),)),
        Message("tool", "2", tool_call_id=call_id),
    ]
    prompt = ChatTemplate(MISTRAL_TEMPLATE).render(history)
    assert f'"id":"{call_id}"' in prompt.replace(" ", "")
    # OpenAI's shape elsewhere — which this template refuses.
    hermes_id = parser_for("hermes").feed('<tool_call>{"name": "f"}</tool_call>').calls[0].id
    assert hermes_id is not None and hermes_id.startswith("call_")
    with pytest.raises(BackendError, match="length 9"):
        ChatTemplate(MISTRAL_TEMPLATE).render(
            [history[0], Message("assistant", "", (ToolCall(hermes_id, "add", "{}"),))]
        )


_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(alphabet='ab"\\}]{[:,é😀\n<>/', max_size=8),
)
_VALUE = st.recursive(
    _LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=10,
)
_WRAPS = {
    "hermes": "Hi <tool_call>\n{}\n</tool_call>",
    "llama3": "<|python_tag|>{}",
    "mistral": "Hi [TOOL_CALLS][{}]",
    "generic": '{{"tool_call": {}}}',
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    syntax=st.sampled_from(sorted(_WRAPS)),
    arguments=st.dictionaries(st.text(max_size=6), _VALUE, max_size=4),
    spacing=st.sampled_from([(", ", ": ", None), (",", ":", None), (",", ": ", 2)]),
    ascii_only=st.booleans(),
    cuts=st.lists(st.integers(1, 10_000), max_size=8),
)
def test_any_arguments_stream_as_the_models_exact_text(
    syntax: Syntax,
    arguments: dict[str, object],
    spacing: tuple[str, str, int | None],
    ascii_only: bool,
    cuts: list[int],
) -> None:
    """Whatever JSON the arguments hold, however it is spaced and split:
    the call's fragments join to exactly the text the model wrote."""
    item, key, indent = spacing
    text = json.dumps(arguments, separators=(item, key), indent=indent, ensure_ascii=ascii_only)
    args_key = "parameters" if syntax == "llama3" else "arguments"
    call = f'{{"name": "add", "{args_key}": {text}}}'
    data = _WRAPS[syntax].format(call).encode()
    points = sorted({cut for cut in cuts if cut < len(data)})
    content, calls, errors = run(syntax, data, points)
    assert errors == []
    assert calls == [("call_0", "add", text)]
    assert content == ("Hi " if syntax in ("hermes", "mistral") else "")
    assert json.loads(calls[0][2]) == arguments
