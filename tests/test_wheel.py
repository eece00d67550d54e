"""The package as a user gets it: sdist → wheel → a fresh venv, run from outside the checkout.

The checkout is copied (without .venv, caches or build output) and built with
``python -m build --no-isolation``, which makes the sdist and then builds the
wheel *from the sdist*, so a file the sdist forgets breaks the wheel here. The
wheel goes into a new venv without pip (the test venv's pip installs into it
through ``--python``; its dependencies come from the registry through the pip
cache) and without llama-cpp-python, and every command runs from an empty
temporary directory with a clean environment.
"""

from __future__ import annotations

import http.client
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import tomllib
import venv
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT, timeout

import wsserver
from wsserver.cli import LLAMA_CMAKE_ARGS

pytestmark = [pytest.mark.wheel, pytest.mark.timeout(timeout(600))]

VERSION = wsserver.__version__
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
LLAMA_EXTRA = PYPROJECT["project"]["optional-dependencies"]["llama"]
LLAMA_PIN = next(r for r in LLAMA_EXTRA if r.startswith("llama-cpp-python=="))
#: What the server serves, as paths below clients/ in the checkout.
SERVED = sorted(
    [
        p.relative_to(ROOT / "clients").as_posix()
        for p in (ROOT / "clients/web").rglob("*")
        if p.is_file()
    ]
    + ["js/wsserver.js", "js/wsserver.d.ts"]
)
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", "artifacts", ".*_cache",
    ".hypothesis", "node_modules", "*.gguf",
)  # fmt: skip


@dataclass(frozen=True)
class Dist:
    sdist: Path
    wheel: Path


@dataclass(frozen=True)
class Installed:
    python: Path
    bin: Path
    #: An empty directory outside the checkout that every command runs in.
    cwd: Path
    env: dict[str, str]

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            args, cwd=self.cwd, env=self.env, capture_output=True, text=True,
            timeout=timeout(120),
        )  # fmt: skip


def _check(args: list[str], **kwargs: object) -> None:
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout(300), **kwargs)  # type: ignore[call-overload]
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    base = tmp_path_factory.mktemp("wheel-build")
    source = base / "source"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCE)
    out = base / "dist"
    _check([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)])
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Dist(sdist=sdist, wheel=wheel)


@pytest.fixture(scope="module")
def installed(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    home = tmp_path_factory.mktemp("wheel-venv")
    env_dir = home / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    _check(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(python),
         "install", "-q", str(dist.wheel)]
    )  # fmt: skip
    cwd = home / "elsewhere"
    cwd.mkdir()
    # Nothing of the test run may leak in: no WSSERVER_* settings, no paths to the checkout.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("WSSERVER_") and k not in {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"}
    }
    return Installed(python=python, bin=env_dir / "bin", cwd=cwd, env=env)


def test_sdist_and_wheel_agree_on_version_and_carry_licence_and_changelog(dist: Dist) -> None:
    assert dist.sdist.name == f"wsserver-{VERSION}.tar.gz"
    assert dist.wheel.name == f"wsserver-{VERSION}-py3-none-any.whl"
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"## {VERSION}" in changelog, "CHANGELOG.md needs a section for the package version"
    top = f"wsserver-{VERSION}"
    with tarfile.open(dist.sdist) as sdist:
        names = set(sdist.getnames())
        for name in ("LICENSE", "CHANGELOG.md", "pyproject.toml", "clients/__init__.py",
                     "config/default.toml", *(f"clients/{p}" for p in SERVED)):  # fmt: skip
            assert f"{top}/{name}" in names, name
        member = sdist.extractfile(f"{top}/PKG-INFO")
        assert member is not None
        pkg_info = member.read().decode()
    with zipfile.ZipFile(dist.wheel) as wheel:
        metadata = wheel.read(f"{top}.dist-info/METADATA").decode()
        licence = wheel.read(f"{top}.dist-info/licenses/LICENSE")
    assert licence == (ROOT / "LICENSE").read_bytes()
    for meta in (pkg_info, metadata):
        assert f"\nVersion: {VERSION}\n" in meta
        # The changelog is part of the long description of both.
        assert changelog.strip() in meta


def test_wheel_holds_every_module_and_every_served_file(dist: Dist) -> None:
    with zipfile.ZipFile(dist.wheel) as wheel:
        names = set(wheel.namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "wsserver").rglob("*.py")}
    client = ROOT / "clients/python"
    modules |= {p.relative_to(client).as_posix() for p in client.rglob("wsserver_client/*.py")}
    assert modules - names == set(), "modules missing from the wheel (list them in pyproject.toml)"
    assert {f"wsserver/clients/{p}" for p in SERVED} - names == set()
    for name in SERVED:
        with zipfile.ZipFile(dist.wheel) as wheel:
            assert wheel.read(f"wsserver/clients/{name}") == (ROOT / "clients" / name).read_bytes()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"wsserver", "wsserver_client", f"wsserver-{VERSION}.dist-info"}


def test_installed_package_reads_nothing_from_the_checkout(installed: Installed) -> None:
    result = installed.run(
        str(installed.python), "-c",
        "import wsserver, wsserver.aio.web; print(wsserver.__file__); print(wsserver.aio.web.CLIENTS_DIR)",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    package, clients = result.stdout.split()
    prefix = str(installed.python.parents[1])
    for path in (package, clients):
        assert path.startswith(prefix) and not path.startswith(str(ROOT)), path


def test_entry_points_work_from_any_directory(installed: Installed) -> None:
    show = installed.run(str(installed.bin / "wsserver"), "config", "show")
    assert show.returncode == 0, show.stderr
    assert re.search(r'^kind = "llama"\s+# default$', show.stdout, re.M), show.stdout
    version = installed.run(str(installed.python), "-m", "wsserver", "--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"wsserver {VERSION}")
    chat = installed.run(str(installed.bin / "wsserver-chat"), "--help")
    assert chat.returncode == 0, chat.stderr


def test_llama_backend_without_llama_cpp_says_how_to_build_it(installed: Installed) -> None:
    assert installed.run(str(installed.python), "-c", "import llama_cpp").returncode != 0
    result = installed.run(str(installed.bin / "wsserver"), "serve")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    command = (
        f'CMAKE_ARGS="{LLAMA_CMAKE_ARGS}" FORCE_CMAKE=1 \\\n'
        f"    {installed.python} -m pip install --no-cache-dir {LLAMA_PIN}\n"
    )
    assert command in result.stderr
    assert LLAMA_CMAKE_ARGS == "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
    # The default model and what the backend needs beside llama-cpp-python,
    # each quoted for the shell (a pin like "jinja2>=3.1" would be a redirection).
    others = [r for r in LLAMA_EXTRA if not r.startswith("llama-cpp-python")]
    assert any(r.startswith("gemma3-270m") for r in others)
    assert f"-m pip install {' '.join(shlex.quote(r) for r in others)}\n" in result.stderr
    for why in ("-march=native", "AMX", "SIGILL", "wheel cache ignores CMAKE_ARGS"):
        assert why in result.stderr.replace("\n", " "), why


class _Lines:
    """A child's stderr, read line by line on a thread, so reads can time out."""

    def __init__(self, stream: object) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, units: float = 60.0) -> re.Match[str]:
        while True:
            try:
                line = self._queue.get(timeout=timeout(units))
            except queue.Empty:
                raise AssertionError(f"no {pattern!r} in:\n{''.join(self.seen)}") from None
            if line is None:
                raise AssertionError(f"exited before {pattern!r}:\n{''.join(self.seen)}")
            self.seen.append(line)
            match = re.search(pattern, line)
            if match:
                return match

    def rest(self) -> str:
        self._thread.join(timeout(30))
        while not self._queue.empty():
            line = self._queue.get()
            if line is not None:
                self.seen.append(line)
        return "".join(self.seen)


@pytest.fixture
def served(installed: Installed) -> Iterator[tuple[int, subprocess.Popen[str], _Lines]]:
    process = subprocess.Popen(
        [str(installed.bin / "wsserver"), "serve", "--backend", "fake", "--port", "0"],
        cwd=installed.cwd, env=installed.env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines = _Lines(process.stderr)
    try:
        port = int(lines.wait_for(r"listening on ws://127\.0\.0\.1:(\d+)/").group(1))
        yield port, process, lines
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout(30))
        lines.rest()  # the reader thread has seen the end of the pipe
        assert process.stderr is not None
        process.stderr.close()


def _get(port: int, path: str) -> tuple[int, str, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout(10))
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        connection.close()


def test_installed_server_serves_its_page_from_outside_the_checkout(
    served: tuple[int, subprocess.Popen[str], _Lines],
) -> None:
    port, process, lines = served
    assert _get(port, "/healthz")[0] == 200
    status, content_type, body = _get(port, "/")
    assert (status, content_type) == (200, "text/html; charset=utf-8")
    assert body == (ROOT / "clients/web/index.html").read_bytes()
    status, content_type, body = _get(port, "/wsserver.js")
    assert (status, content_type) == (200, "text/javascript; charset=utf-8")
    assert body == (ROOT / "clients/js/wsserver.js").read_bytes()
    # A service manager stops it with SIGTERM: a clean, graceful exit.
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout(30)) == 0, lines.rest()
    assert "stopped" in lines.rest()


def test_install_script_builds_llama_cpp_as_the_message_says() -> None:
    script = (ROOT / "scripts/install").read_text(encoding="utf-8")
    assert f'LLAMA_CMAKE_ARGS="{LLAMA_CMAKE_ARGS}"' in script
    assert f'LLAMA_VERSION="{LLAMA_PIN.split("==")[1]}"' in script
