"""Chat templates as the model means them (wsserver/backends/llama_template.py).

Tiny GGUFs carry templates written for these tests — a Hermes/Qwen-style one
with tools, a Llama-3-style one, one that opens a think block in the
generation prompt — and the prompt the engine feeds must be the template's own
rendering, as llama-cpp-python's ``Jinja2ChatFormatter`` makes it. Templates
are code inside model files: ``raise_exception`` and sandbox escapes are
refused with a clean ``bad_request``, over the WebSocket and the OpenAI API.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from conftest import running_server, timeout, wire  # noqa: E402
from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # noqa: E402
from test_llama_backend import llama_config, loaded, request, run  # noqa: E402
from tiny_gguf import write_tiny_gguf  # noqa: E402

from wsserver.backends.llama import LlamaBackend  # noqa: E402
from wsserver.backends.llama_template import ChatTemplate, template_messages  # noqa: E402
from wsserver.core.protocol import Generate, Limits, Message, ToolCall, parse_client_frame  # noqa: E402
from wsserver.errors import BackendError, ModelLoadError, ProtocolError  # noqa: E402

pytestmark = pytest.mark.llama

HERMES = """{{ bos_token }}
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each call return <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

LLAMA3 = """{{ bos_token }}
{%- for message in messages %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{% if message.tool_calls %}{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}{% endfor %}
{%- elif message.role == 'tool' %}{"output": {{ message.content | tojson }}}
{%- else %}{{ message.content | trim }}{% endif %}<|eot_id|>
{%- endfor %}
{%- if tools and add_generation_prompt %}<|start_header_id|>system<|end_header_id|>

Tools: {{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}<|eot_id|>
{%- endif %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

THINKING = """{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>
{% endfor %}{% if add_generation_prompt %}<assistant><think>
{% endif %}"""

STRICT = """{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}
{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}
{{ m.content }}{% endfor %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def frame(**fields: Any) -> Generate:
    result = parse_client_frame(json.dumps({"type": "generate", "id": "t", **fields}), Limits())
    assert isinstance(result, Generate)
    return result


def reference_prompt(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """The template's own rendering, by llama-cpp-python's formatter (Transformers' inputs:
    a call's arguments as an object)."""
    converted = json.loads(json.dumps(messages))
    for message in converted:
        for call in message.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    formatter = Jinja2ChatFormatter(template=template, eos_token="</s>", bos_token="<s>")
    return formatter(messages=converted, **kwargs).prompt


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaBackend]:
    path = write_tiny_gguf(tmp_path_factory.mktemp("hermes") / "h.gguf", chat_template=HERMES)
    with loaded(path) as backend:
        yield backend


# ---------------------------------------------------------------- rendering


@pytest.mark.parametrize("template", [HERMES, LLAMA3, THINKING], ids=["hermes", "llama3", "think"])
def test_the_prompt_is_the_templates_own_rendering(template: str) -> None:
    chat = ChatTemplate(template, bos_token="<s>", eos_token="</s>")
    messages = frame(messages=CONVERSATION).messages
    assert messages is not None
    for tools in (None, [WEATHER]):
        expected = reference_prompt(template, CONVERSATION, tools=tools)
        assert chat.render(messages, tools=tools) == expected
    kwargs = {"enable_thinking": False}
    assert chat.render(messages, extra=kwargs) == reference_prompt(template, CONVERSATION, **kwargs)


def test_developer_is_system_and_arguments_reach_the_template_as_an_object() -> None:
    messages = (
        Message("developer", "Be brief."),
        Message("assistant", "", (ToolCall("c", "f", '{"a": 1}'), ToolCall("d", "g", "not json"))),
    )
    rendered = template_messages(messages)
    assert rendered[0] == {"role": "system", "content": "Be brief."}
    calls = rendered[1]["tool_calls"]
    assert rendered[1]["content"] is None
    assert calls[0]["function"]["arguments"] == {"a": 1}
    assert calls[1]["function"]["arguments"] == "not json"  # passed as given


def test_the_engine_feeds_the_rendered_prompt(hermes: LlamaBackend) -> None:
    generate = frame(messages=CONVERSATION, tools=[WEATHER], max_tokens=4)
    req = request(None, messages=generate.messages, tools=generate.tools, max_tokens=4)
    expected = reference_prompt(HERMES, CONVERSATION, tools=[WEATHER])
    assert expected.startswith("<s><|im_start|>system\nYou are terse.\n\n# Tools\n<tools>\n")
    tokens = hermes.vocab.tokenize(expected, add_bos=False)
    assert tokens[0] == hermes.vocab.bos[0]  # the template's BOS, not a second one
    assert hermes.tokenize_prompt(req) == tokens
    outcome, _ = run(hermes, req)
    assert (outcome.reason, outcome.prompt_tokens) == ("length", len(tokens))


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "source",
    [
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{{ joiner.__init__.__globals__ }}",
        "{{ lipsum.__globals__['os'] }}",
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__ }}",
        "{{ raise_exception.__globals__ }}",
        "{% set x = [] %}{{ x.append(1) }}",
        "{{ messages[0].update({'role': 'x'}) }}",
        "{{ 'a' * 10000000000 }}",
        "{{ 2 ** 100000 }}",
        "{% for i in range(10000000000) %}{% endfor %}",
    ],
)
def test_sandbox_escapes_are_refused_as_bad_request(source: str) -> None:
    chat = ChatTemplate(source)
    with pytest.raises(BackendError) as caught:
        chat.render((Message("user", "hi"),))
    assert caught.value.code == "bad_request"
    assert "Traceback" not in str(caught.value)


def test_raise_exception_is_a_bad_request_with_the_templates_words() -> None:
    chat = ChatTemplate(STRICT)
    assert chat.render((Message("user", "hi"),)) == "hi"
    with pytest.raises(BackendError, match="Only user and assistant roles") as caught:
        chat.render((Message("system", "s"), Message("user", "hi")))
    assert caught.value.code == "bad_request"


def test_a_template_that_does_not_compile_fails_the_load(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "bad.gguf", chat_template="{% for %}")
    with pytest.raises(ModelLoadError, match="chat_template_file"):
        LlamaBackend(model=str(path), n_threads=1).load()


def test_the_template_file_overrides_the_models(tmp_path: Path, tiny_gguf: Path) -> None:
    override = tmp_path / "t.jinja"
    override.write_text(THINKING)
    with loaded(tiny_gguf, chat_template_file=str(override)) as backend:
        req = request(None, messages=(Message("user", "Hi"),), max_tokens=2)
        expected = reference_prompt(THINKING, [{"role": "user", "content": "Hi"}])
        assert backend.tokenize_prompt(req) == backend.vocab.tokenize(expected, add_bos=False)
    with pytest.raises(ModelLoadError, match="cannot read"):
        LlamaBackend(model=str(tiny_gguf), chat_template_file=str(tmp_path / "missing")).load()


def test_check_refuses_before_the_start(hermes: LlamaBackend, tiny_gguf: Path) -> None:
    hermes.check(frame(messages=CONVERSATION, tools=[WEATHER]))  # shown: accepted
    # A template that does not show tools: the server would describe them and
    # hold the answer to a grammar — which would constrain the think block this
    # one opens, so it is refused.
    think = ChatTemplate(THINKING)
    hermes.chat.template, saved = think, hermes.chat.template
    try:
        with pytest.raises(ProtocolError, match="think block") as caught:
            hermes.check(frame(messages=CONVERSATION, tools=[WEATHER]))
        assert caught.value.code == "unsupported_option"
        hermes.chat.template = ChatTemplate(STRICT)
        with pytest.raises(ProtocolError, match="Only user and assistant") as caught:
            hermes.check(frame(messages=CONVERSATION))
        assert caught.value.code == "bad_request"
    finally:
        hermes.chat.template = saved
    with loaded(tiny_gguf) as plain:  # no template: the server describes the tools
        plain.check(frame(messages=CONVERSATION, tools=[WEATHER]))
        with pytest.raises(ProtocolError, match="needs a chat template") as caught:
            plain.check(frame(messages=CONVERSATION, chat_template_kwargs={"x": 1}))
        assert caught.value.code == "unsupported_option"


# ---------------------------------------------------------------- on the wires


async def test_websocket_and_openai_take_tool_conversations(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "hermes.gguf", chat_template=HERMES)
    async with running_server(llama_config(path)) as server, wire(server) as client:
        await client.send(
            {
                "type": "generate",
                "id": "ws",
                "messages": CONVERSATION,
                "tools": [WEATHER],
                "chat_template_kwargs": {"enable_thinking": False},
                "max_tokens": 3,
                "temperature": 0,
            }
        )
        _, frames = await client.done("ws")
        expected = reference_prompt(HERMES, CONVERSATION, tools=[WEATHER], enable_thinking=False)
        backend = server.backend
        assert isinstance(backend, LlamaBackend)
        n_prompt = len(backend.vocab.tokenize(expected, add_bos=False))
        assert frames[-1]["usage"]["prompt_tokens"] == n_prompt
        api = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(30),
        )
        try:
            reply = await api.chat.completions.create(
                model="hermes",
                messages=CONVERSATION,  # type: ignore[arg-type]
                tools=[WEATHER],  # type: ignore[list-item]
                max_tokens=3,
                temperature=0,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )
            assert reply.usage is not None and reply.usage.prompt_tokens == n_prompt
            with pytest.raises(openai.BadRequestError) as refused:
                await api.chat.completions.create(
                    model="hermes",
                    messages=[{"role": "tool", "content": "x"}],  # type: ignore[list-item]
                    max_tokens=3,
                )
            assert "tool_call_id" in str(refused.value)
        finally:
            await api.close()


async def test_template_refusals_reach_both_wires_as_bad_request(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "strict.gguf", chat_template=STRICT + "{{ ''.__class__ }}")
    async with running_server(llama_config(path)) as server, wire(server) as client:
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
        await client.send({"type": "generate", "id": "a", "messages": messages})
        error = await client.recv()
        assert (error["type"], error["code"], error["id"]) == ("error", "bad_request", "a")
        assert "Only user and assistant roles" in error["message"]
        await client.send({"type": "generate", "id": "b", "messages": messages[1:]})
        error = await client.recv()
        assert (error["code"], error["id"]) == ("bad_request", "b")
        assert "'__class__' is not allowed" in error["message"]
        api = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(30),
        )
        try:
            with pytest.raises(openai.BadRequestError) as refused:
                await api.chat.completions.create(model="strict", messages=messages)  # type: ignore[arg-type]
            assert refused.value.status_code == 400
            assert "Only user and assistant roles" in str(refused.value)
        finally:
            await api.close()


async def test_a_template_that_opens_the_think_block_starts_in_reasoning(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", chat_template=THINKING)
    async with running_server(llama_config(path)) as server, wire(server) as client:
        chat = [{"role": "user", "content": "Hi"}]
        await client.send(
            {"type": "generate", "id": "a", "messages": chat, "max_tokens": 8, "temperature": 0}
        )
        text, frames = await client.done("a")
        # The tiny model never writes "</think>": all of it is reasoning.
        assert text == ""
        assert "".join(f.get("reasoning", "") for f in frames if f["type"] == "delta")
        usage = frames[-1]["usage"]
        assert usage["reasoning_tokens"] == usage["completion_tokens"] == 8
        await client.send(
            {"type": "generate", "id": "b", "messages": chat, "json_schema": {"type": "object"}}
        )
        error = await client.recv()
        assert (error["type"], error["code"]) == ("error", "unsupported_option")


#: As Qwen 3's template does, an assistant turn's content is searched for a
#: think block — which fails on ``content: null``, a call-only turn's content.
SEARCHES_CONTENT = """{%- for m in messages %}<|im_start|>{{ m.role }}
{%- if m.role == 'assistant' and '</think>' in m.content %} (thought){% endif %}
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_that_needs_string_content_gets_an_empty_string_for_a_call_only_turn() -> None:
    template = ChatTemplate(SEARCHES_CONTENT, bos_token="<s>", eos_token="</s>")
    assert template.string_content
    messages = frame(messages=CONVERSATION).messages
    assert messages is not None
    prompt = template.render(messages)
    with_empty = [dict(m, content=m["content"] or "") for m in CONVERSATION]
    assert prompt == reference_prompt(SEARCHES_CONTENT, with_empty)
    # A template that takes null content keeps getting it.
    assert not ChatTemplate(HERMES).string_content


#: Qwen 3's handling of reasoning, condensed: an assistant message's
#: ``reasoning_content`` (else a think block in its content) is rendered as
#: ``<think>…</think>`` only after the last user query — the tool-use loop in
#: progress — and earlier turns' is left out; like Qwen 3's, it looks for a
#: think block ``in`` the content (so a call-only turn needs ``""``).
QWEN3_REASONING = """{%- set ns = namespace(last_query=messages|length - 1, multi_step=true) %}
{%- for m in messages[::-1] %}{% set i = messages|length - 1 - loop.index0 %}
{%- if ns.multi_step and m.role == 'user' %}{% set ns.multi_step = false %}{% set ns.last_query = i %}{% endif %}
{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}
{%- set content = m.content %}{% set reasoning = '' %}
{%- if m.reasoning_content is defined and m.reasoning_content is not none %}{% set reasoning = m.reasoning_content %}
{%- elif '</think>' in m.content %}{% set reasoning = m.content.split('</think>')[0].split('<think>')[-1] %}
{%- set content = m.content.split('</think>')[-1] %}{% endif %}
{%- if loop.index0 > ns.last_query and reasoning %}<|im_start|>assistant
<think>
{{ reasoning.strip() }}
</think>

{{ content }}{% else %}<|im_start|>assistant
{{ content }}{% endif %}
{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

#: A tool-use loop in progress: the assistant thought, called, got the result.
LOOP = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning": "The user wants Paris: call get_weather.",
        "tool_calls": CONVERSATION[2]["tool_calls"],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def test_the_reasoning_of_the_loop_in_progress_reaches_the_template() -> None:
    template = ChatTemplate(QWEN3_REASONING, bos_token="<s>", eos_token="</s>")
    assert template.string_content  # a call-only turn gets "" (not null)
    messages = frame(messages=LOOP).messages
    assert messages is not None
    prompt = template.render(messages)
    # The template's own rendering, given llama.cpp's reasoning_content.
    as_llama_cpp = [
        {k: v for k, v in m.items() if k != "reasoning"}
        | ({"reasoning_content": m["reasoning"], "content": ""} if "reasoning" in m else {})
        for m in LOOP
    ]
    assert prompt == reference_prompt(QWEN3_REASONING, as_llama_cpp)
    assert "<think>\nThe user wants Paris: call get_weather.\n</think>\n\n<tool_call>" in prompt
    # Once the user asks again the loop is over: its reasoning is left out.
    later = frame(messages=[*LOOP, {"role": "user", "content": "And Rome?"}]).messages
    assert later is not None
    assert "The user wants Paris" not in template.render(later)
    # Without reasoning the turn is the plain call-only turn.
    bare = frame(messages=[{k: v for k, v in m.items() if k != "reasoning"} for m in LOOP])
    assert bare.messages is not None and "<think>" not in template.render(bare.messages)
