"""The architecture, checked: the layers, the seam, and no import cycle.

* The sans-I/O core (protocol, session, pacing, textstream, security), the
  leaves (errors, config, logs) and the engine seam (backends/base.py) import
  no I/O framework: no asyncio, websockets, janus, prometheus_client or
  llama_cpp — checked in a fresh interpreter, so indirect imports count too.
* None of them imports anything from the asyncio layer (``wsserver.aio``).
* No import cycle anywhere in the package: the graph of imports between
  wsserver's modules, read from the source with :mod:`ast` (imports inside
  functions and ``TYPE_CHECKING`` blocks included), has no cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "wsserver"

SANS_IO = [
    "wsserver.protocol",
    "wsserver.client_frames",
    "wsserver.session",
    "wsserver.pacing",
    "wsserver.textstream",
    "wsserver.sse",
    "wsserver.security",
    "wsserver.errors",
    "wsserver.config",
    "wsserver.logs",
    "wsserver.backends.base",
    "wsserver.backends.openai_wire",
    "wsserver.openai_api",
]

IO_FRAMEWORKS = ("asyncio", "websockets", "janus", "prometheus_client", "llama_cpp", "aiohttp")


@pytest.mark.parametrize("module", SANS_IO)
def test_sans_io_modules_import_no_io_framework(module: str) -> None:
    code = (
        "import sys\n"
        f"import {module}\n"
        f"bad = sorted(m for m in {IO_FRAMEWORKS!r} if m in sys.modules)\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"{module} pulls in {result.stdout.strip()}"


def test_only_the_llama_backend_imports_llama_cpp() -> None:
    code = (
        "import sys, wsserver.aio, wsserver.cli, wsserver.backends.fake; "
        "print('llama_cpp' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_only_the_openai_backend_imports_aiohttp() -> None:
    code = (
        "import sys, wsserver.aio, wsserver.cli, wsserver.backends.fake; "
        "print('aiohttp' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_graph() -> dict[str, set[str]]:
    """wsserver module → the wsserver modules it imports (anywhere in its source)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                # ``from pkg import name`` imports pkg.name if that is a module.
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_import_graph_is_read_correctly() -> None:
    # The check below is only as good as the graph: spot-check known edges.
    graph = _import_graph()
    assert "wsserver.aio.connection" in graph["wsserver.aio.server"]
    assert "wsserver.backends.base" in graph["wsserver.aio.pipeline"]
    assert "wsserver.backends.llama" in graph["wsserver.backends"]  # a lazy import
    assert "wsserver.protocol" in graph["wsserver.session"]
    assert "wsserver" in graph["wsserver.aio.server"]  # from .. import __version__


def test_no_import_cycle_in_the_package() -> None:
    cycle = _find_cycle(_import_graph())
    assert cycle is None, "import cycle: " + " → ".join(cycle or [])


def test_a_cycle_would_be_found() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("module", SANS_IO)
def test_the_core_and_the_seam_import_nothing_from_the_asyncio_layer(module: str) -> None:
    imported = _import_graph()[module]
    assert not [m for m in imported if m.startswith("wsserver.aio")], imported
