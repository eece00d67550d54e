"""The output shaper (wsserver/shaping.py), sans-I/O: golden outputs per syntax.

One scripted output per tool call syntax (hermes, llama3, mistral, generic,
any, relay) goes through a :class:`~wsserver.shaping.shaper.Shaper` whole, cut in
two at every position, and a character at a time — through the text
assembler, byte by byte, too — and gives exactly the same parts every time:
the reasoning, the answer's text, the calls (id, name, the arguments their
fragments join to) and the request's outcome. Then the outcome rules: a
call the model stopped after is ``tool_calls``, a refused call is
``invalid_tool_call``, a call cut by ``max_tokens`` is released as far as it
got; and what a request without a think block or without tools gets. No
event loop.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from wsserver.core.call_parts import CallPart
from wsserver.core.events import Outcome
from wsserver.core.logprobs import TokenLogprob
from wsserver.core.protocol import Generate, Message
from wsserver.core.textstream import TextAssembler
from wsserver.shaping.shaper import OutputFormat, Shaper
from wsserver.shaping.tool_calls import Syntax

TOOLS = json.dumps(
    [
        {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
        for name in ("get_weather", "add")
    ]
)
ASK = (Message("user", "Weather in Paris?"),)


@dataclass
class Recorded:
    """A :class:`~wsserver.shaping.shaper.Parts` that keeps everything it is given."""

    reasoning: list[str] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    parts: list[CallPart] = field(default_factory=list)
    tokens: int = 0
    reasoning_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, text: str, tokens: int, logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        self.text.append(text)
        self.tokens += tokens
        self.logprobs.extend(logprobs)

    def add_reasoning(self, text: str, tokens: int) -> None:
        self.reasoning.append(text)
        self.tokens += tokens
        self.reasoning_tokens += tokens

    def add_calls(self, parts: tuple[CallPart, ...]) -> None:
        self.parts.extend(parts)

    def calls(self) -> list[tuple[str, str, str]]:
        """(id, name, joined arguments) per call, checking the parts' order:
        a call's first part has its id and name, its later ones neither."""
        calls: dict[int, list[str]] = {}
        for part in self.parts:
            if part.index not in calls:
                assert part.id is not None and part.name is not None
                calls[part.index] = [part.id, part.name, ""]
            else:
                assert part.id is None and part.name is None
            calls[part.index][2] += part.arguments
        assert sorted(calls) == list(range(len(calls)))
        return [(c[0], c[1], c[2]) for c in calls.values()]


@dataclass(frozen=True)
class Golden:
    reasoning: str
    text: str
    calls: list[tuple[str, str, str]]
    reason: str
    error: str | None = None


def request(**fields: Any) -> Generate:
    base: dict[str, Any] = {"id": "r", "messages": ASK, "tools": TOOLS}
    return Generate(**(base | fields))


def shaper(syntax: Syntax, *, opened: bool = False, **fields: Any) -> Shaper:
    counter = itertools.count()
    return Shaper(
        request(**fields),
        OutputFormat(opens_reasoning=opened, tool_syntax=syntax),
        new_id=lambda: f"call_{next(counter)}",
    )


STOP = Outcome("stop")


def shaped(shape: Shaper, pieces: list[str | CallPart], outcome: Outcome = STOP) -> Golden:
    """Each piece (text, one token; or a part of a call the engine parsed)
    through ``shape``, then its end."""
    out = Recorded()
    for piece in pieces:
        if isinstance(piece, CallPart):
            shape.call(out, piece, 1)
        else:
            shape.text(out, piece, 1)
    end = shape.end(out, outcome)
    return Golden(
        "".join(out.reasoning), "".join(out.text), out.calls(), end.reason, end.error_message
    )


def cuts(text: str) -> list[list[str]]:
    """``text`` whole, in two at every position, and a character at a time."""
    ways = [[text], list(text)]
    ways += [[text[:cut], text[cut:]] for cut in range(1, len(text))]
    return ways


WEATHER = '{"city": "Paris", "unit": "°C"}'

#: A model's output per syntax: (syntax, the prompt opened a think block, output, golden).
MODEL_OUTPUTS: list[tuple[Syntax, bool, str, Golden]] = [
    (
        # Qwen 3: the template opened the block; the call follows the answer's text.
        "hermes",
        True,
        "Paris, 日本? </th no.</think>\n\nLet me look. <tool_call>\n"
        '{"name": "get_weather", "arguments": ' + WEATHER + "}\n</tool_call>\n"
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
        Golden(
            "Paris, 日本? </th no.",
            "Let me look. ",
            [("call_0", "get_weather", WEATHER), ("call_1", "add", '{"a": 1}')],
            "tool_calls",
        ),
    ),
    (
        "llama3",
        False,
        '<think>plan é</think> <|python_tag|>{"name": "get_weather", "parameters": '
        + WEATHER
        + '}; {"name": "add", "parameters": {"a": [1, "}"]}}',
        Golden(
            "plan é",
            "",
            [("call_0", "get_weather", WEATHER), ("call_1", "add", '{"a": [1, "}"]}')],
            "tool_calls",
        ),
    ),
    (
        "mistral",
        False,
        'Sure 😀 [TOOL_CALLS][{"id": "abc123XYZ", "name": "get_weather", "arguments": '
        + WEATHER
        + '}, {"name": "add", "arguments": "{\\"a\\": 2}"}]',
        Golden(
            "",
            "Sure 😀 ",
            [("abc123XYZ", "get_weather", WEATHER), ("call_0", "add", '{"a":2}')],
            "tool_calls",
        ),
    ),
    (
        "generic",
        False,
        '<think>no tool needed</think>\n{"response": "Just text \\u00e9 \\"q\\""}',
        Golden("no tool needed", 'Just text é "q"', [], "stop"),
    ),
    (
        "generic",
        False,
        ' {"tool_calls": [{"name": "add", "arguments": {"a": 1}}, '
        '{"name": "get_weather", "arguments": ' + WEATHER + "}]}",
        Golden(
            "",
            "",
            [("call_0", "add", '{"a": 1}'), ("call_1", "get_weather", WEATHER)],
            "tool_calls",
        ),
    ),
    (
        "any",
        False,
        'Hm [x] <tool_call>{"name": "add", "arguments": {}}</tool_call>\n'
        '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + WEATHER + "}]",
        Golden(
            "",
            "Hm [x] ",
            [("call_0", "add", "{}"), ("call_1", "get_weather", WEATHER)],
            "tool_calls",
        ),
    ),
    (
        # Hermes syntax with no call in it: the answer, as it came.
        "hermes",
        False,
        "<think>\n</think>\n\nNo call here <tool but text <tool_cal",
        Golden("\n", "No call here <tool but text <tool_cal", [], "stop"),
    ),
]


@pytest.mark.parametrize(
    ("syntax", "opened", "output", "golden"),
    MODEL_OUTPUTS,
    ids=[f"{case[0]}-{number}" for number, case in enumerate(MODEL_OUTPUTS)],
)
def test_a_models_output_gives_the_same_parts_split_anywhere(
    syntax: Syntax, opened: bool, output: str, golden: Golden
) -> None:
    for pieces in cuts(output):
        assert shaped(shaper(syntax, opened=opened), list(pieces)) == golden, pieces
    # Byte by byte through the text assembler: every character in pieces.
    data = output.encode()
    assembler = TextAssembler()
    pieces = [assembler.feed(data[at : at + 1]) for at in range(len(data))]
    assert shaped(shaper(syntax, opened=opened), [*pieces, assembler.flush()]) == golden


#: What the openai backend's relay hands over: the upstream's reasoning in the
#: text between the markers, its content, and its calls as parts (the
#: upstream's indexes, ids, names and fragments).
RELAYED: list[str | CallPart] = [
    "<think>",
    "The user wants ",
    "the weather.",
    "</think>",
    "Checking",
    CallPart(3, "", "call_up_1", "get_weather"),
    CallPart(3, '{"city": '),
    " now <tool_call>",
    CallPart(3, '"Paris"}'),
    CallPart(5, "{}", None, "add"),
]


def test_relayed_calls_are_parts_and_the_text_is_content() -> None:
    golden = Golden(
        "The user wants the weather.",
        "Checking now <tool_call>",
        [("call_up_1", "get_weather", '{"city": "Paris"}'), ("call_0", "add", "{}")],
        "tool_calls",
    )
    assert shaped(shaper("relay"), list(RELAYED)) == golden
    # The text split anywhere, the parts where they came.
    for number, piece in enumerate(RELAYED):
        if isinstance(piece, str):
            for pieces in cuts(piece):
                split = [*RELAYED[:number], *pieces, *RELAYED[number + 1 :]]
                assert shaped(shaper("relay"), split) == golden, split
    # Each fragment is released as it came, not gathered.
    out = Recorded()
    shape = shaper("relay")
    for piece in RELAYED[:7]:
        if isinstance(piece, CallPart):
            shape.call(out, piece, 1)
        else:
            shape.text(out, piece, 1)
    assert [p.arguments for p in out.parts] == ["", '{"city": ']
    # A call that ends a think block still undecided: what was held is answer.
    assert shaped(shaper("relay"), ["\n", CallPart(0, "{}", "c", "add"), " ok"]) == Golden(
        "", "\n ok", [("c", "add", "{}")], "tool_calls"
    )


@pytest.mark.parametrize(
    ("syntax", "pieces", "golden"),
    [
        (
            "hermes",
            ['<tool_call>{"name": "rm", "arguments": {}}</tool_call>'],
            Golden(
                "",
                "",
                [],
                "error",
                "the model called 'rm', which is not one of the request's tools",
            ),
        ),
        (
            "llama3",
            ['{"name": "add", "parameters": {"a": }}'],
            Golden(
                "",
                "",
                [("call_0", "add", "")],
                "error",
                'the model\'s tool call is not valid JSON: \'{"name": "add", "parameters": {"a": }}\'',
            ),
        ),
        (
            "relay",
            [CallPart(0, '{"ci', "c", "add")],
            Golden(
                "",
                "",
                [("c", "add", '{"ci')],
                "error",
                "the arguments of the upstream's call to 'add' are not valid JSON",
            ),
        ),
    ],
)
def test_a_refused_call_ends_the_request_as_an_invalid_tool_call(
    syntax: Syntax, pieces: list[str | CallPart], golden: Golden
) -> None:
    assert shaped(shaper(syntax), pieces) == golden
    # A model's call refused as it came: an error, also when the output was
    # then cut; an upstream's last call cut is as far as it got (below).
    length = shaped(shaper(syntax), pieces, Outcome("length")).reason
    assert length == ("length" if syntax == "relay" else "error")
    # A request that ended otherwise first ends so.
    assert shaped(shaper(syntax), pieces, Outcome("cancelled")).reason == "cancelled"


def test_a_call_cut_by_max_tokens_is_released_as_far_as_it_got() -> None:
    text = 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    cut = Golden("", "Hi ", [("call_0", "get_weather", '{"city": "Par')], "length")
    for pieces in cuts(text):
        assert shaped(shaper("hermes"), list(pieces), Outcome("length")) == cut
    # The same output ended by the model itself: a malformed call.
    stopped = shaped(shaper("hermes"), [text])
    assert (stopped.reason, stopped.error) == (
        "error",
        "the model's tool call was cut off before its end",
    )
    # An upstream's last call, cut: as far as it got, not refused.
    relayed = shaped(shaper("relay"), [CallPart(0, '{"ci', "c", "add")], Outcome("length"))
    assert relayed == Golden("", "", [("c", "add", '{"ci')], "length")


def test_a_stop_after_calls_is_tool_calls_and_forgets_the_stop_string() -> None:
    calls = ['<tool_call>{"name": "add", "arguments": {}}</tool_call>']
    out = Recorded()
    shape = shaper("hermes")
    shape.text(out, calls[0], 3)
    end = shape.end(out, Outcome("stop", 5, 3, stop_sequence="\nUser:"))
    assert (end.reason, end.stop_sequence, end.prompt_tokens, end.completion_tokens) == (
        "tool_calls",
        None,
        5,
        3,
    )
    assert out.tokens == 3  # the call's tokens count as the answer's
    # No call: the engine's outcome as it was.
    plain = shaper("hermes").end(Recorded(), Outcome("stop", stop_sequence="x"))
    assert plain == Outcome("stop", stop_sequence="x")


def test_what_is_not_asked_for_is_not_shaped() -> None:
    thought = "<think>hm</think>ok <tool_call>"
    # reasoning_format "none", or a prompt rather than messages: no think block.
    for fields in (
        {"reasoning_format": "none", "tools": None},
        {"messages": None, "prompt": "p", "tools": None},
    ):
        golden = Golden("", thought, [], "stop")
        assert shaped(shaper("hermes", **fields), [thought]) == golden
    # No tools, or tool_choice "none": no calls looked for.
    for fields in ({"tools": None}, {"tool_choice": "none"}):
        golden = Golden("hm", "ok <tool_call>", [], "stop")
        assert shaped(shaper("hermes", **fields), [thought]) == golden
    # …and a part an engine hands over then is dropped (its tokens still count).
    out = Recorded()
    shape = shaper("relay", tools=None)
    shape.call(out, CallPart(0, "{}", "c", "add"), 2)
    assert (out.parts, out.tokens, shape.end(out, Outcome("stop")).reason) == ([], 2, "stop")


def test_tokens_and_logprobs_go_with_what_they_made() -> None:
    entry = TokenLogprob("x", -0.5, b"x")
    out = Recorded()
    shape = shaper("hermes", tools=None)
    shape.text(out, "<think>a", 2)
    shape.text(out, "b</think>", 1)
    shape.text(out, " c", 1, (entry,))
    shape.end(out, Outcome("stop"))
    assert ("".join(out.reasoning), "".join(out.text)) == ("ab", "c")
    assert (out.reasoning_tokens, out.tokens, out.logprobs) == (3, 4, [entry])
    # One call asked for: what follows it is not read.
    one = shaped(
        shaper("hermes", parallel_tool_calls=False),
        ['<tool_call>{"name": "add"}</tool_call><tool_call>{"name": "add"}</tool_call> x'],
    )
    assert one == Golden("", "", [("call_0", "add", "{}")], "tool_calls")
