"""``wsserver pull`` and ``wsserver models``, run as a user runs them: a process,
its environment (``HF_ENDPOINT``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``) pointing
at the local imitation of the Hub and a temporary cache."""

from __future__ import annotations

import json
import os
import pty
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import timeout
from fake_hub import FakeHub, sha256

MiB = 1 << 20
REPO = "org/tiny-GGUF"
WSSERVER = str(Path(sys.executable).parent / "wsserver")


@pytest.fixture
def files() -> dict[str, bytes]:
    return {
        "tiny-Q4_K_M.gguf": os.urandom(5 * MiB),
        "tiny-Q8_0.gguf": os.urandom(MiB),
        "mmproj-tiny-F16.gguf": os.urandom(1000),
    }


@pytest.fixture
def hub(files: dict[str, bytes]) -> Iterator[FakeHub]:
    with FakeHub() as fake:
        fake.add_repo(REPO, files)
        yield fake


def environment(hub: FakeHub, cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "WSSERVER_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(cache), **extra)
    return env


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [WSSERVER, *args], env=env, capture_output=True, text=True, timeout=timeout(60)
    )


def pull_process(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [WSSERVER, "pull", "org/tiny-GGUF"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


class Lines:
    """A process's stderr, read line by line on a thread."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        assert process.stderr is not None
        self._stream = process.stderr
        self._lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._stream:
            self._lines.put(line)
        self._lines.put("")

    def close(self) -> None:
        self._reader.join(timeout(10))
        self._stream.close()

    def until(self, text: str) -> str:
        while True:
            line = self._lines.get(timeout=timeout(30))
            assert line, f"the process ended before saying {text!r}: {self.seen}"
            self.seen.append(line)
            if text in line:
                return line


def test_a_pull_prints_plain_progress_and_the_models_path(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    env = environment(hub, tmp_path)
    result = run("pull", "org/tiny-GGUF", env=env)
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip())
    assert path.read_bytes() == files["tiny-Q4_K_M.gguf"]
    assert path.is_relative_to(tmp_path)
    lines = result.stderr.splitlines()
    assert lines[0] == f"pulling org/tiny-GGUF from {hub.url}"
    assert "\r" not in result.stderr  # not a terminal: no redrawn line
    assert any(line.startswith("downloading tiny-Q4_K_M.gguf: 100%") for line in lines)
    assert "org/tiny-GGUF: downloaded 5.2 MB, verified" in result.stderr
    assert "multimodal projector:" in result.stderr
    assert "serve it: wsserver serve --model hf:org/tiny-GGUF" in result.stderr
    again = run("pull", "hf:org/tiny-GGUF", env=env)
    assert again.returncode == 0 and "already cached, verified" in again.stderr
    assert again.stdout == result.stdout
    # Offline, from the cache alone.
    offline = run("pull", "org/tiny-GGUF", env={**env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 0 and offline.stdout == result.stdout


def test_on_a_terminal_the_progress_is_a_bar_with_size_rate_and_time_left(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    primary, secondary = pty.openpty()
    digest = sha256(files["tiny-Q4_K_M.gguf"])
    with hub.held(digest, after=3 * MiB) as fault:
        process = subprocess.Popen(
            [WSSERVER, "pull", "org/tiny-GGUF"],
            env=environment(hub, tmp_path, COLUMNS="120"),
            stdout=subprocess.PIPE,
            stderr=secondary,
            text=True,
        )
        os.close(secondary)
        screen = b""
        while b"left" not in screen:  # the bar with its rate and time left is drawn
            screen += os.read(primary, 4096)
        fault.release.set()
        out, _ = process.communicate(timeout=timeout(30))
    with_more = b""
    try:
        while chunk := os.read(primary, 4096):
            with_more += chunk
    except OSError:
        pass
    os.close(primary)
    screen += with_more
    assert process.returncode == 0
    text = screen.decode()
    assert "\r\x1b[2K" in text  # one line, redrawn in place
    assert "tiny-Q4_K_M.gguf [" in text and "%" in text
    assert "MB / 5.2 MB" in text and "/s" in text and "left" in text
    assert Path(out.strip()).read_bytes() == files["tiny-Q4_K_M.gguf"]


def test_ctrl_c_keeps_what_was_fetched_and_the_same_command_resumes(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    model = files["tiny-Q4_K_M.gguf"]
    digest = sha256(model)
    env = environment(hub, tmp_path)
    with hub.held(digest, after=2 * MiB + MiB // 2) as fault:
        process = pull_process(env)
        lines = Lines(process)
        lines.until("downloading tiny-Q4_K_M.gguf: 40%")  # 2 MiB written
        process.send_signal(signal.SIGINT)
        lines.until("interrupted")
        fault.release.set()
        assert process.wait(timeout(30)) == 130
        lines.close()
    partial = tmp_path / "models--org--tiny-GGUF" / "blobs" / f"{digest}.incomplete"
    kept = partial.stat().st_size
    assert kept == 2 * MiB
    listing = run("models", env=env)
    assert "partial download: org/tiny-GGUF (2.1 MB so far" in listing.stdout

    result = run("pull", "org/tiny-GGUF", env=env)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).read_bytes() == model
    last = hub.gets_of(digest)[-1]
    assert last.start == kept and last.sent == len(model) - kept


def test_a_killed_pull_is_resumed_by_the_next(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    model = files["tiny-Q4_K_M.gguf"]
    digest = sha256(model)
    env = environment(hub, tmp_path)
    with hub.held(digest, after=3 * MiB + 100):
        process = pull_process(env)
        lines = Lines(process)
        lines.until("downloading tiny-Q4_K_M.gguf: 60%")  # 3 MiB written
        process.kill()
        process.wait(timeout(30))
        lines.close()
    result = run("pull", "org/tiny-GGUF", env=env)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).read_bytes() == model
    last = hub.gets_of(digest)[-1]
    assert last.start == 3 * MiB and last.sent == len(model) - 3 * MiB


def test_refusals_have_their_exit_status(hub: FakeHub, tmp_path: Path) -> None:
    env = environment(hub, tmp_path)
    bad = run("pull", "org/repo/../../etc/passwd.gguf", env=env)
    assert bad.returncode == 2 and "not a model reference" in bad.stderr
    missing = run("pull", "org/tiny-GGUF:Q5_K_M", env=env)
    assert missing.returncode == 1
    assert "hub_not_found: org/tiny-GGUF has no Q5_K_M GGUF" in missing.stderr
    capped = run("pull", "org/tiny-GGUF", "--set", "models.max_download_bytes=1000", env=env)
    assert capped.returncode == 1 and "download_too_large" in capped.stderr
    offline = run("pull", "org/tiny-GGUF", env={**env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 1 and "hub_unreachable" in offline.stderr


def test_models_lists_the_cache_with_sizes_and_users_and_removes_one(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    env = environment(hub, tmp_path / "cache")
    assert run("pull", "org/tiny-GGUF", env=env).returncode == 0
    assert run("pull", "org/tiny-GGUF:Q8_0", env=env).returncode == 0
    config = tmp_path / "models.toml"
    config.write_text(
        '[[backend.llama.models]]\nname = "chat"\nmodel = "hf:org/tiny-GGUF:Q4_K_M"\n'
    )
    listing = run("models", "--config", str(config), env=env)
    assert listing.returncode == 0, listing.stderr
    rows = listing.stdout.splitlines()
    assert rows[0] == f"cache: {tmp_path / 'cache'}"
    assert rows[1].split() == ["MODEL", "QUANT", "SIZE", "USED", "BY"]
    q4 = next(r for r in rows if "tiny-Q4_K_M.gguf" in r)
    assert q4.split()[:3] == ["org/tiny-GGUF/tiny-Q4_K_M.gguf", "Q4_K_M", "5.2"]
    assert q4.endswith("chat (backend.llama.models[0])")
    q8 = next(r for r in rows if "tiny-Q8_0.gguf" in r)
    assert q8.endswith("-")
    assert any("mmproj-tiny-F16.gguf  [projector]" in r for r in rows)
    data = json.loads(run("models", "--json", "--config", str(config), env=env).stdout)
    by_path = {m["path"]: m for m in data["models"]}
    assert by_path["tiny-Q4_K_M.gguf"]["size"] == len(files["tiny-Q4_K_M.gguf"])
    assert by_path["tiny-Q4_K_M.gguf"]["used_by"] == ["chat (backend.llama.models[0])"]
    assert by_path["mmproj-tiny-F16.gguf"]["projector"] is True

    # A model the configuration uses is removed only with --force.
    refused = run("models", "--remove", "org/tiny-GGUF:Q4_K_M", "--config", str(config), env=env)
    assert refused.returncode == 1 and "used by chat" in refused.stderr
    removed = run("models", "--remove", "org/tiny-GGUF:Q8_0", env=env)
    assert removed.returncode == 0, removed.stderr
    assert sha256(files["tiny-Q8_0.gguf"]) in removed.stdout
    left = json.loads(run("models", "--json", env=env).stdout)["models"]
    assert {m["path"] for m in left} == {"tiny-Q4_K_M.gguf", "mmproj-tiny-F16.gguf"}
    forced = run("models", "--remove", "org/tiny-GGUF", "--force", "--config", str(config), env=env)
    assert forced.returncode == 0, forced.stderr
    assert json.loads(run("models", "--json", env=env).stdout)["models"] == []
    assert not (tmp_path / "cache" / "models--org--tiny-GGUF").exists()
    gone = run("models", "--remove", "org/tiny-GGUF", env=env)
    assert gone.returncode == 1 and "not in the cache" in gone.stderr


def test_partial_downloads_can_be_deleted(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    blobs = tmp_path / "models--org--tiny-GGUF" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{sha256(files['tiny-Q4_K_M.gguf'])}.incomplete").write_bytes(b"x" * 1000)
    env = environment(hub, tmp_path)
    result = run("models", "--remove-partial", "org/tiny-GGUF", env=env)
    assert result.returncode == 0 and ".incomplete" in result.stdout
    assert list(blobs.iterdir()) == []
