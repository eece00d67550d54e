"""Audio over the WebSocket protocol: a user message's ``audio``, base64 or uploads.

Against a real server serving the tiny text model with a tiny whisper
projector (``tests/tiny_audio.py``) as "listener": a sound by upload or by
base64 reads as OpenAI's chat API's ``input_audio`` part does (the same text,
the same prompt tokens); a message's images come before its sounds; the
Python client uploads bytes and file paths; refusals name the clip.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp.mtmd_cpp")

from conftest import running_server, wire
from test_anthropic_http import post
from test_llama_backend import llama_config
from test_ws_images import answer, refused, upload
from tiny_audio import AUDIO_TOKENS, sine_wav, write_tiny_audio_mmproj

LOW = sine_wav(220.0)
HIGH = sine_wav(1760.0)


@pytest.fixture(scope="module")
def listener(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    mmproj = write_tiny_audio_mmproj(tmp_path_factory.mktemp("audio") / "a.mmproj.gguf")
    return llama_config(
        tiny_gguf,
        backend__llama__parallel=1,
        backend__llama__n_ctx=1024,
        backend__llama__models=[
            {"name": "listener", "model": str(tiny_gguf), "mmproj": str(mmproj)}
        ],
    )


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def hear(request_id: str, *sounds: Any, **more: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "user", "content": "Hear", **more}
    if sounds:
        message["audio"] = list(sounds)
    return {
        "type": "generate",
        "id": request_id,
        "model": "listener",
        "messages": [message],
        "max_tokens": 12,
        "temperature": 0,
    }


async def test_a_sound_by_upload_or_base64_reads_as_the_openai_wires_does(
    listener: Any,
) -> None:
    async with running_server(listener) as server:
        async with wire(server) as client:
            _, plain = await answer(client, hear("t"))
            await upload(client, "snd-1", LOW)  # several binary frames
            by_upload, done = await answer(client, hear("u", {"upload": "snd-1"}))
            by_base64, _ = await answer(client, hear("b", b64(LOW)))
            by_url, _ = await answer(client, hear("d", "data:audio/wav;base64," + b64(LOW)))
            other, _ = await answer(client, hear("h", b64(HIGH)))
            error = await refused(client, hear("x", b64(LOW), "bm90IGF1ZGlv"))
            assert error["code"] == "bad_request"
            assert "audio 1 (messages[0].audio[1]): not a WAV, MP3 or FLAC" in error["message"]
            error = await refused(client, hear("y", images=[b64(LOW)]))
            assert "image 0 (messages[0].images[0]): not a PNG" in error["message"]
        part = {"type": "input_audio", "input_audio": {"data": b64(LOW), "format": "wav"}}
        body = {
            "model": "listener",
            "max_tokens": 12,
            "temperature": 0,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "Hear"}]}],
        }
        status, openai = await post(server, "/v1/chat/completions", body)
    assert status == 200, openai
    assert by_upload == by_base64 == by_url == openai["choices"][0]["message"]["content"]
    assert done["usage"]["prompt_tokens"] == openai["usage"]["prompt_tokens"]
    window = AUDIO_TOKENS["ultravox"]
    assert done["usage"]["prompt_tokens"] - plain["usage"]["prompt_tokens"] >= window
    assert by_upload != other


async def test_the_python_client_sends_sound_paths_and_bytes(listener: Any, tmp_path: Path) -> None:
    from wsserver_client import Client

    path = tmp_path / "low.wav"
    path.write_bytes(LOW)
    options = {"model": "listener", "max_tokens": 12, "temperature": 0}

    def asking(*sounds: Any) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "Hear", "audio": list(sounds)}]

    async with running_server(listener) as server:
        async with wire(server) as raw:
            expected, _ = await answer(raw, hear("r", b64(LOW)))
        async with Client(server.url) as client:
            by_path = await client.generate(messages=asking(path), **options).result()
            by_bytes = await client.generate(messages=asking(LOW), **options).result()
    assert by_path.text == by_bytes.text == expected
