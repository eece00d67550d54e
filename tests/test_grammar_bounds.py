"""The grammar and schema bounds (wsserver.backends.grammar_bounds), before
any native code: the grammars that crash or jam llama.cpp are refused by
name, realistic grammars and schemas pass, and the parser reads GBNF as
llama.cpp's does (checked against it where llama-cpp-python is installed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from grammars import DEEP_SCHEMA, JAM, PYDANTIC_LIKE

from wsserver.backends.grammar_bounds import (
    MAX_FANOUT,
    MAX_GRAMMAR_BYTES,
    MAX_NESTING,
    MAX_REPEAT,
    MAX_REPETITION_PRODUCT,
    MAX_SCHEMA_COUNT,
    MAX_START_DEPTH,
    check_gbnf,
    check_schema,
)
from wsserver.errors import BackendError


def refused(text: str) -> BackendError:
    with pytest.raises(BackendError) as caught:
        check_gbnf(text)
    return caught.value


@pytest.mark.parametrize(
    ("grammar", "code", "says"),
    [
        ('root ::= "a"{5,2}', "bad_request", "{5,2}, whose minimum is above its maximum"),
        (JAM, "unsupported_option", f"multiply to more than {MAX_REPETITION_PRODUCT}"),
        ('root ::= (("a"{1,10}){1,10}){1,10}', "unsupported_option", "multiply"),
        ('root ::= "a"{0,3000}', "unsupported_option", f"a count above {MAX_REPEAT}"),
        ('root ::= "a"{2001}', "unsupported_option", "{2001,2001}"),
        ('root ::= "a"{99999999999999999999}', "unsupported_option", "99999999999999999999"),
        ('root ::= "(" root{0,2} ")" | "a"', "unsupported_option", "contains itself"),
        ("root ::= " + "(" * 20000 + '"a"' + ")" * 20000, "unsupported_option", "1000 deep"),
        ('root ::= "a" | *', "bad_request", "without an item"),
        ('root ::= "a"\nroot ::= b', "bad_request", "'b' is not defined"),
        ('start ::= "a"', "bad_request", "no 'root' rule"),
        ("root ::= x\nx ::= x? y\ny ::= root", "bad_request", "left-recursive"),
        ('root ::= "a\x00"', "bad_request", "NUL"),
        ('root ::= "\\q"', "bad_request", "unknown escape"),
        ('root ::= ("a"', "bad_request", "expecting ')'"),
    ],
)
def test_grammars_that_crash_jam_or_mislead_llama_cpp_are_refused_by_name(
    grammar: str, code: str, says: str
) -> None:
    error = refused(grammar)
    assert error.code == code, error
    assert str(error).startswith("'grammar' ")
    assert says in str(error), error


def test_wide_deep_and_large_grammars_are_refused_naming_the_bound() -> None:
    # r8 ::= r7? r7? r7? r7?, and so on down: 190 bytes, 3 s to parse natively.
    nested = ["root ::= r8", 'r0 ::= "a"'] + [f"r{i} ::= {f'r{i - 1}? ' * 4}" for i in range(1, 9)]
    assert f"at most {MAX_FANOUT}" in str(refused("\n".join(nested)))
    alternatives = " | ".join(f'"w{i}"' for i in range(MAX_FANOUT + 1))
    assert f"more than {MAX_FANOUT} parse stacks" in str(refused(f"root ::= {alternatives}"))
    chain = ["root ::= r0"] + [f'r{i} ::= r{i + 1} "x"' for i in range(2000)] + ['r2000 ::= "y"']
    assert f"at most {MAX_START_DEPTH}" in str(refused("\n".join(chain)))
    big = "root ::= " + '"a" ' * (MAX_GRAMMAR_BYTES // 4)
    assert f"at most {MAX_GRAMMAR_BYTES}" in str(refused(big))
    # llama.cpp copies a literal whole for each count: 2,000 x 1,000 characters.
    unrolled = 'root ::= "' + "a" * 1000 + '"{2000}'
    assert "grammar elements" in str(refused(unrolled))


REALISTIC = [
    'root ::= "<" [a-z]{1,8} ">"',
    'root ::= ([0-9]{1,3} "."){3} [0-9]{1,3}',
    # Up to 20 words of up to 10 letters: two nested counts, 11 x 21 = 231.
    'root ::= ([a-z]{1,10} " "){1,20}',
    'root ::= [0-9]{4} "-" [0-9]{2} "-" [0-9]{2} ("T" [0-9]{2} ":" [0-9]{2})?',
    # llama.cpp's grammars/json.gbnf, comments and all.
    r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
""",
    'root ::= "yes" | "no" # a comment\n',
    'root ::= ("a" | "b")* "c"+ "d"? [^\\n]* . <[42]> !<[7]>',
    "root ::= x\r\nx ::= [\\x41-\\u005A\\U0001F600]",
    'root ::= "(" root ")" | ""',
]


@pytest.mark.parametrize("grammar", REALISTIC)
def test_realistic_grammars_pass(grammar: str) -> None:
    check_gbnf(grammar)


def test_the_measures_of_a_grammar_just_under_each_bound() -> None:
    # Two nested counts of 15 multiply to 16 x 16 = 256: the most served.
    shape = check_gbnf('root ::= (("a"{0,15}){0,15})')
    assert shape.repetition_product == MAX_REPETITION_PRODUCT
    shape = check_gbnf("root ::= " + "(" * MAX_NESTING + '"a"' + ")" * MAX_NESTING)
    assert shape.nesting == MAX_NESTING
    shape = check_gbnf("root ::= " + " | ".join(f'"w{i}"' for i in range(MAX_FANOUT)))
    assert shape.fanout == MAX_FANOUT


# ---------------------------------------------------------------- JSON Schema


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        (DEEP_SCHEMA, f"maxItems 100000 at the top level (at most {MAX_SCHEMA_COUNT}"),
        ({"type": "string", "maxLength": 5000}, "maxLength 5000"),
        ({"type": "array", "items": {"type": "string"}, "minItems": 1e300}, "minItems 1e+300"),
        (
            {"type": "object", "properties": {"a": {"type": "string", "pattern": "^x{1,99999}$"}}},
            "at properties.a that repeats something 99999 times",
        ),
        ({"type": "string", "pattern": "^((ab{1,100}){1,100}){1,100}$"}, "nested, write more"),
        (
            {"type": "array", "prefixItems": [{"type": "string", "maxLength": 900}] * 30},
            "more than 20000 repeated items",
        ),
    ],
)
def test_schemas_the_converter_would_blow_up_are_refused_before_it_runs(
    schema: dict[str, Any], says: str
) -> None:
    with pytest.raises(BackendError) as caught:
        check_schema(schema)
    assert caught.value.code == "unsupported_option"
    assert str(caught.value).startswith("'json_schema' ")
    assert says in str(caught.value), caught.value


def test_a_pydantic_like_schema_passes_both_checks() -> None:
    converter = pytest.importorskip("llama_cpp.llama_grammar")
    check_schema(PYDANTIC_LIKE)
    shape = check_gbnf(converter.json_schema_to_gbnf(json.dumps(PYDANTIC_LIKE)))
    assert shape.nesting <= MAX_NESTING and shape.repetition_product <= MAX_REPETITION_PRODUCT


@pytest.mark.parametrize("count", [1, 50, 500, MAX_SCHEMA_COUNT])
def test_array_and_string_bounds_up_to_the_limit_convert_and_pass(count: int) -> None:
    converter = pytest.importorskip("llama_cpp.llama_grammar")
    for schema in (
        {"type": "array", "items": {"type": "integer"}, "maxItems": count},
        {"type": "array", "items": {"type": "integer"}, "minItems": count, "maxItems": count},
        {"type": "string", "minLength": 0, "maxLength": count},
    ):
        check_schema(schema)
        check_gbnf(converter.json_schema_to_gbnf(json.dumps(schema)))


# ---------------------------------------------------------------- as llama.cpp reads it

#: Grammars llama.cpp parses, or refuses (syntax, undefined rules, left
#: recursion): this parser must agree, never refusing what it reads well.
SYNTAX = [
    *REALISTIC,
    'root ::= "a"',
    'root ::= "a" "b" | "c"',
    'root ::= (\n  "a"\n  | "b"\n)',
    'root ::= "a" # trailing\n# only a comment\n',
    'root ::= "a"{3}',
    'root ::= "a"{3,}',
    'root ::= "a"{ 2 , 5 }',
    'root ::= ("a"{2}){3}',
    'root ::= "a"{2}{3}',
    'root ::= ""',
    "root ::= [\\]a-]",
    'root ::= "\\x4"',
    'root ::= "a" "b',
    'root ::= "a"\n"b"',
    "root ::= [a-",
    'root ::= ("a" | )',
    'root ::= x\nx ::= "a"',
    "root ::= x",
    "root ::= root",
    'root ::= "a"*?',
    'root ::= ""*',
    "root ::= {1}",
    'root ::= "a"{1,2,3}',
    'root ::= "a" }',
    'root ::= "a" :: "b"',
    'root ::= "a"\n\n\nx ::= "b"',
    'root ::= "a"\rx ::= "b"',
    'root::="a"',
]


@pytest.mark.llama
@pytest.mark.parametrize("grammar", SYNTAX)
def test_the_parser_accepts_what_llama_cpp_accepts(grammar: str, tiny_gguf: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    vocab = _vocab(llama_cpp, tiny_gguf)
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
    native = bool(sampler)
    if sampler:
        llama_cpp.llama_sampler_free(sampler)
    try:
        check_gbnf(grammar)
        ours = True
    except BackendError as exc:
        assert exc.code == "bad_request", exc
        ours = False
    assert ours == native, (grammar, ours, native)


_VOCABS: dict[str, Any] = {}


def _vocab(llama_cpp: Any, path: Path) -> Any:
    if str(path) not in _VOCABS:
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        _VOCABS[str(path)] = llama_cpp.llama_model_get_vocab(model)
    return _VOCABS[str(path)]
