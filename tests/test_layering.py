"""The architecture, checked: the sans-I/O core imports no I/O framework."""

from __future__ import annotations

import subprocess
import sys

import pytest

SANS_IO = [
    "wsserver.protocol",
    "wsserver.session",
    "wsserver.pacing",
    "wsserver.textstream",
    "wsserver.errors",
]


@pytest.mark.parametrize("module", SANS_IO)
def test_sans_io_modules_import_neither_asyncio_nor_websockets(module: str) -> None:
    code = (
        "import sys\n"
        f"import {module}\n"
        "bad = sorted(m for m in ('asyncio', 'websockets', 'janus', 'llama_cpp') if m in sys.modules)\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"{module} pulls in {result.stdout.strip()}"


def test_only_the_llama_backend_imports_llama_cpp() -> None:
    code = "import sys, wsserver.server, wsserver.backends.fake; print('llama_cpp' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
