"""The architecture, checked: the layers, the seam, and no import cycle.

* The sans-I/O core (``wsserver/core``), output shaping (``wsserver/shaping``),
  the dialects' parsers and renderers (``wsserver/dialects``), the leaves
  (errors, config, logs, security) and the engine seam (backends/base.py) import
  no I/O framework: no asyncio, websockets, janus, prometheus_client or
  llama_cpp — checked in a fresh interpreter, so indirect imports count too.
* None of them imports anything from the asyncio layer (``wsserver.aio``).
* The sans-I/O core (every module of ``wsserver/core``: protocol, client
  frames, session, events, request records, replay tails, …) loads neither the engines' package
  (``wsserver.backends``) nor the configuration: the core depends on no engine.
* ``wsserver/core`` imports neither ``shaping`` nor ``dialects``, and
  ``shaping`` imports no dialect: the packages' order is the import direction.
* Each wire dialect — the WebSocket protocol, the OpenAI HTTP API, the
  Responses API, Anthropic's Messages API, Ollama's API — imports no other dialect's
  modules: what they share is the request driver's, the HTTP dialects'
  the HTTP exchange's (``dialects/exchange.py``, ``aio/exchange.py``, the seam
  ``aio/http_route.py``), which imports no dialect, and the WebSocket
  dialects' the one WebSocket connection's (``aio/socket_connection.py``,
  ``sender.py``, ``peer.py``).
* The request's way, the same for every wire — the request driver, the
  pipeline and what they share with every dialect — imports no websockets:
  the socket layer translates websockets' ``ConnectionClosed`` into the
  core's :class:`~wsserver.errors.WireLost` at the seam.
* No import cycle in wsserver, in bench or in the Python client
  (``wsserver_client``): the graph of imports between each package's own
  modules, read from the source with :mod:`ast` (imports inside functions
  and ``TYPE_CHECKING`` blocks included), has no cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "wsserver"
#: The packages held to "no import cycle", by name: each one's own modules.
PACKAGES = {
    "wsserver": PACKAGE,
    "bench": ROOT / "bench",
    "wsserver_client": ROOT / "clients" / "python" / "wsserver_client",
}


def modules_in(package: str) -> list[str]:
    """Every module of one of wsserver's packages, by name (the package's own)."""
    folder = ROOT.joinpath(*package.split("."))
    return sorted(
        package if path.stem == "__init__" else f"{package}.{path.stem}"
        for path in folder.glob("*.py")
    )


#: The core a request's state lives in — every module of ``wsserver/core``,
#: the list the README's architecture gives: sans-I/O, and above the engines.
CORE = modules_in("wsserver.core")

#: The dialects' halves without I/O, one package each (``wsserver/dialects``).
DIALECT_PACKAGES = ("openai", "anthropic", "responses", "ollama", "embeddings")

#: Each dialect's own modules (a wire's parsing, rendering and transport): its
#: package under ``wsserver/dialects`` and its asyncio half.
DIALECTS = {
    "websocket": {"wsserver.aio.connection", "wsserver.aio.embed_requests"},
    **{name: set(modules_in(f"wsserver.dialects.{name}")) for name in DIALECT_PACKAGES},
}
DIALECTS["openai"] |= {"wsserver.aio.openai_routes"}
DIALECTS["anthropic"] |= {"wsserver.aio.anthropic_http"}
DIALECTS["ollama"] |= {"wsserver.aio.ollama_http"}
DIALECTS["embeddings"] |= {"wsserver.aio.embedding_routes"}
DIALECTS["responses"] |= {
    "wsserver.aio.responses_run",
    "wsserver.aio.responses_http",
    "wsserver.aio.responses_socket",
}

SANS_IO = [
    *CORE,
    *modules_in("wsserver.shaping"),
    *modules_in("wsserver.dialects"),
    *(m for name in DIALECT_PACKAGES for m in modules_in(f"wsserver.dialects.{name}")),
    "wsserver.sse",
    "wsserver.security",
    "wsserver.errors",
    "wsserver.config",
    "wsserver.logs",
    "wsserver.backends.base",
    "wsserver.backends.request",
    "wsserver.backends.openai_wire",
    "wsserver.backends.gguf_meta",
    "wsserver.backends.int_range",
    "wsserver.backends.token_text",
    "wsserver.backends.fake_embed",
    "wsserver.backends.llama_speculation",
    "wsserver.pull",
    "wsserver.pull.reference",
    "wsserver.pull.progress",
    "wsserver.pull.requests",
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


@pytest.mark.parametrize("module", CORE)
def test_the_core_loads_no_engine_and_no_configuration(module: str) -> None:
    code = (
        "import sys\n"
        f"import {module}\n"
        "bad = sorted(m for m in sys.modules"
        " if m.startswith('wsserver.backends') or m in ('wsserver.config', 'asyncio', 'websockets'))\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"{module} pulls in {result.stdout.strip()}"


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_no_dialect_imports_another(dialect: str) -> None:
    graph = _import_graph()
    others = set().union(*(m for name, m in DIALECTS.items() if name != dialect))
    for module in DIALECTS[dialect]:
        assert module in graph, f"{module} is not a module any more: update DIALECTS"
        crossing = graph[module] & others
        assert not crossing, f"{module} imports {sorted(crossing)}"


#: The sans-I/O packages in the order they may import each other: each one
#: only those before it (the README's tree: shaping stands on the core, the
#: dialects on both).
SANS_IO_PACKAGES = ("wsserver.core", "wsserver.shaping", "wsserver.dialects")


@pytest.mark.parametrize("package", SANS_IO_PACKAGES)
def test_the_sans_io_packages_import_in_one_direction(package: str) -> None:
    graph = _import_graph()
    later = SANS_IO_PACKAGES[SANS_IO_PACKAGES.index(package) + 1 :]
    mine = [m for m in graph if m == package or m.startswith(package + ".")]
    assert mine, f"{package} has no modules any more: update SANS_IO_PACKAGES"
    for module in mine:
        crossing = sorted(t for t in graph[module] if t.startswith(tuple(p + "." for p in later)))
        assert not crossing, f"{module} imports {crossing}"


#: What every HTTP dialect stands on: the HTTP exchange (both halves), the
#: seam to the routes, the answer's writing, the transport's write side.
HTTP_SHARED = [
    "wsserver.dialects.api_errors",
    "wsserver.dialects.exchange",
    "wsserver.aio.exchange",
    "wsserver.aio.http_route",
    "wsserver.aio.http_answer",
    "wsserver.aio.http_out",
]


@pytest.mark.parametrize("module", HTTP_SHARED)
def test_the_http_exchange_imports_no_dialect(module: str) -> None:
    graph = _import_graph()
    dialects = set().union(*DIALECTS.values())
    assert module in graph, f"{module} is not a module any more: update HTTP_SHARED"
    crossing = graph[module] & dialects
    assert not crossing, f"{module} imports {sorted(crossing)}"


#: The request's way through the asyncio layer, the same for every wire: it
#: knows no transport library (issue 34; the socket layer translates).
WIRE_NEUTRAL = [
    "wsserver.aio.driver",
    "wsserver.aio.pipeline",
    "wsserver.aio.pump",
    "wsserver.aio.channel",
    "wsserver.aio.scheduler",
    "wsserver.aio.services",
    "wsserver.aio.resume",
    "wsserver.aio.responses_run",
    "wsserver.aio.exchange",
    "wsserver.aio.embed_run",
]


@pytest.mark.parametrize("module", WIRE_NEUTRAL)
def test_the_request_driver_and_pipeline_import_no_websockets(module: str) -> None:
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    assert path.is_file(), f"{module} is not a module any more: update WIRE_NEUTRAL"
    found = sorted(m for m in _absolute_imports(path) if m.partition(".")[0] == "websockets")
    assert not found, f"{module} imports {found}"


def _absolute_imports(path: Path) -> set[str]:
    """The absolute module names a source file imports, anywhere in it."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
    return names


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
    # The image fetch (wsserver/aio/image_fetch.py) uses it too, imported on
    # its first fetch: a server that fetches nothing does not load it.
    code = (
        "import sys, wsserver.aio, wsserver.cli, wsserver.backends.fake; "
        "print('aiohttp' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """The package's module → the package's modules it imports (anywhere in its source)."""
    modules = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        parent = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = parent.rsplit(".", node.level - 1)[0] if node.level > 1 else parent
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


#: Edges known to be there, one of each way of importing: the cycle check is
#: only as good as the graph it reads.
KNOWN_EDGES = [
    ("wsserver.aio.server", "wsserver.aio.connection"),
    ("wsserver.aio.pipeline", "wsserver.backends.base"),
    ("wsserver.backends", "wsserver.backends.llama"),  # a lazy import
    ("wsserver.core.session", "wsserver.core.protocol"),
    ("wsserver.aio.server", "wsserver"),  # from .. import __version__
    ("bench.upstream", "bench.common"),
    ("bench.analysis", "bench.upstream"),
    ("wsserver_client.client", "wsserver_client.core"),
]


@pytest.mark.parametrize(("importer", "imported"), KNOWN_EDGES)
def test_the_import_graph_is_read_correctly(importer: str, imported: str) -> None:
    package = PACKAGES[importer.partition(".")[0]]
    assert imported in _import_graph(package)[importer]


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycle_in_the_package(package: str) -> None:
    cycle = _find_cycle(_import_graph(PACKAGES[package]))
    assert cycle is None, "import cycle: " + " → ".join(cycle or [])


def test_a_cycle_would_be_found() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("module", SANS_IO)
def test_the_core_and_the_seam_import_nothing_from_the_asyncio_layer(module: str) -> None:
    imported = _import_graph()[module]
    assert not [m for m in imported if m.startswith("wsserver.aio")], imported


def test_the_asyncio_layers_module_tree_names_every_module() -> None:
    import wsserver.aio

    doc = wsserver.aio.__doc__ or ""
    names = {p.stem for p in (PACKAGE / "aio").glob("*.py") if p.stem != "__init__"}
    missing = sorted(n for n in names if f" {n} " not in doc and f" {n}," not in doc)
    assert not missing, f"wsserver/aio/__init__.py's tree omits {missing}"
