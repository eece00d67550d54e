"""``wsserver-chat``: an interactive terminal client.

Type a prompt and press Enter; the answer streams as it arrives. Ctrl-C while
an answer streams cancels it *in-band* (a ``cancel`` frame; the connection
stays open); Ctrl-C or Ctrl-D at the prompt quits. ``/regen`` restarts the
last request (a ``restart`` frame), ``/set key=value`` changes a sampling
option (max_tokens, temperature, top_p, top_k, seed) or the model
(``/set model=NAME``; ``--model`` at start), ``/image PATH`` sends an
image file with the next message (a model that reads images: it then goes
as a chat message), ``/quit`` exits. Each answer ends with its timings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from .client import Client, GenerationError, Stream

__all__ = ["main"]

_OPTION_TYPES: dict[str, type] = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "seed": int,
    "model": str,
}


def _format_done(stream: Stream) -> str:
    done = stream.done
    if done is None:
        return "[no result]"
    t = done.timings
    ttft = "-" if t.ttft_ms is None else f"{t.ttft_ms:.0f} ms"
    extra = f" ({done.error_code}: {done.error_message})" if done.error_code else ""
    return (
        f"[{done.reason}{extra} · {done.usage.completion_tokens} tokens · first token {ttft}"
        f" · {t.tokens_per_s:.1f} tok/s · {t.total_ms / 1000:.2f} s]"
    )


class Chat:
    """The interactive loop, with its input and output injectable for tests."""

    def __init__(
        self, client: Client, *, out: TextIO = sys.stdout, options: dict[str, Any] | None = None
    ) -> None:
        self.client = client
        self.out = out
        self.options: dict[str, Any] = dict(options or {})
        self.current: Stream | None = None
        self.last_id: str | None = None
        #: Image files the next message carries (``/image PATH``).
        self.images: list[Path] = []

    def interrupt(self) -> bool:
        """Ctrl-C: cancel the running answer in-band. False if nothing runs."""
        stream = self.current
        if stream is None or stream.done is not None:
            return False
        asyncio.get_running_loop().create_task(self.client.cancel(stream.id))
        return True

    async def stream(self, stream: Stream) -> None:
        self.current = stream
        try:
            async for text in stream:
                self.out.write(text)
                self.out.flush()
            # A cancel ends the loop at once; its done follows.
            await stream.wait_done()
        except GenerationError as exc:
            self.out.write(f"\n[refused: {exc.code}: {exc.message}]\n")
            return
        finally:
            self.current = None
        self.last_id = stream.id
        self.out.write("\n" + _format_done(stream) + "\n")
        self.out.flush()

    async def handle(self, line: str) -> bool:
        """Handle one input line; False means quit."""
        line = line.rstrip("\n")
        if not line.strip():
            return True
        if line.strip() in ("/quit", "/exit"):
            return False
        if line.strip() == "/regen":
            if self.last_id is None:
                self.out.write("[nothing to regenerate yet]\n")
                return True
            await self.stream(self.client.restart(self.last_id, **self.options))
            return True
        if line.startswith("/set "):
            key, _, value = line[5:].partition("=")
            key = key.strip()
            if key not in _OPTION_TYPES:
                self.out.write(f"[unknown option {key!r}; one of {', '.join(_OPTION_TYPES)}]\n")
                return True
            try:
                self.options[key] = _OPTION_TYPES[key](value.strip())
            except ValueError:
                self.out.write(f"[bad value for {key}]\n")
            return True
        if line.startswith("/image "):
            path = Path(line[7:].strip()).expanduser()
            if not path.is_file():
                self.out.write(f"[no file {str(path)!r}]\n")
                return True
            self.images.append(path)
            self.out.write(f"[{path.name} goes with your next message]\n")
            return True
        if self.images:
            images, self.images = self.images, []
            message = {"role": "user", "content": line, "images": images}
            await self.stream(self.client.generate(messages=[message], **self.options))
            return True
        await self.stream(self.client.generate(line, **self.options))
        return True


async def _run(url: str, token: str | None, options: dict[str, Any]) -> int:
    loop = asyncio.get_running_loop()
    try:
        client = Client(url, token=token)
        await client.connect()
    except (OSError, Exception) as exc:
        print(f"wsserver-chat: cannot connect to {url}: {exc}", file=sys.stderr)
        return 1
    hello = client.hello
    assert hello is not None
    model = options.get("model", hello.model)
    others = [m.name for m in hello.models or () if m.name != model]
    also = f" (also: {', '.join(others)})" if others else ""
    print(
        f"connected to {hello.server}, model {model}{also}. "
        "Ctrl-C cancels, /regen restarts, /quit exits."
    )
    chat = Chat(client, options=options)
    quit_event = asyncio.Event()

    def on_sigint() -> None:
        if not chat.interrupt():
            quit_event.set()

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    try:
        while not quit_event.is_set():
            sys.stdout.write("> ")
            sys.stdout.flush()
            read = loop.run_in_executor(None, sys.stdin.readline)
            quit_wait = asyncio.ensure_future(quit_event.wait())
            finished, _ = await asyncio.wait({read, quit_wait}, return_when=asyncio.FIRST_COMPLETED)
            quit_wait.cancel()
            if read not in finished:
                break
            line = read.result()
            if line == "":  # Ctrl-D
                break
            if not await chat.handle(line):
                break
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        with contextlib.suppress(Exception):
            await client.close()
    print()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="wsserver-chat", description="Chat with a wsserver in the terminal."
    )
    parser.add_argument("url", nargs="?", default="ws://127.0.0.1:8765/")
    parser.add_argument("--token", help="auth token, if the server requires one")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--model", help="the model to chat with (default: the server's default)")
    args = parser.parse_args(argv)
    given = {"max_tokens": args.max_tokens, "temperature": args.temperature, "model": args.model}
    options = {k: v for k, v in given.items() if v is not None}
    try:
        return asyncio.run(_run(args.url, args.token, options))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
