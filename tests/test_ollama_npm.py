"""Ollama's official npm client (``ollama``, a pinned dev dependency in
clients/js/package.json, installed by ``scripts/install --test``) under Node.js
against a real server: clients/js/test/ollama.test.js — chat whole and
streamed, generate, thinking and a tool call, format, list/show/ps, abort()
freeing the one slot, errors with Ollama's statuses."""

from __future__ import annotations

from test_js_node import JS, ControlledServer, assert_all_passed, node_command, run_node_tests
from test_js_node import _unavailable as unavailable


async def test_the_ollama_npm_client_against_a_real_server() -> None:
    command = node_command()
    if not (JS / "node_modules" / "ollama" / "package.json").exists():
        unavailable("the ollama npm package is not installed in clients/js")
    async with ControlledServer(
        backend__fake__echo=True, backend__fake__tokens_per_s=300.0, backend__fake__parallel=1
    ) as server:
        returncode, output = await run_node_tests(command, server, "ollama.test.js")
    assert_all_passed(returncode, output)
