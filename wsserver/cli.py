"""Command line: ``wsserver serve``, ``wsserver config show``, ``wsserver pull`` and ``wsserver models``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import importlib.util
import resource
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from . import __version__
from .config import LoadedConfig, describe, load_config
from .errors import ConfigError
from .logs import setup_logging

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wsserver", description="Stream a local LLM over WebSocket."
    )
    parser.add_argument("--version", action="version", version=f"wsserver {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", metavar="PATH", help="TOML configuration file")
        p.add_argument("--host", help="address to bind (server.host)")
        p.add_argument("--port", type=int, help="port to bind, 0 = any free port (server.port)")
        p.add_argument("--backend", choices=("fake", "llama", "openai"), help="backend.kind")
        p.add_argument(
            "--model",
            metavar="PATH",
            help="GGUF file for the llama backend, or a Hub reference: hf:org/repo[:QUANT]",
        )
        p.add_argument(
            "--chat-template-file",
            metavar="PATH",
            help="a Jinja chat template replacing the model's own (backend.llama.chat_template_file)",
        )
        p.add_argument("--log-format", choices=("text", "json"), help="server.log_format")
        p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override any key, e.g. --set stream.flush_ms=20 (repeatable)",
        )

    common(sub.add_parser("serve", help="run the server"))
    config = sub.add_parser("config", help="inspect the configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    common(config_sub.add_parser("show", help="print the effective configuration and its sources"))

    def settings(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", metavar="PATH", help="TOML configuration file ([models])")
        p.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE", help="override any key"
        )

    pull = sub.add_parser(
        "pull",
        help="download a GGUF model from the Hugging Face Hub (docs/models.md)",
        description="Download a GGUF model into the Hub's cache: resumed if interrupted, "
        "verified against the Hub's sha256. Prints the model's path.",
    )
    pull.add_argument(
        "reference",
        help="org/repo (its Q4_K_M GGUF, else Q8_0, else the first), org/repo:QUANT, "
        "or org/repo/path/file.gguf; @revision at the end pins a branch, tag or commit",
    )
    settings(pull)
    models = sub.add_parser(
        "models",
        help="list the cached GGUF models, their size and which configured model uses them",
    )
    models.add_argument("--remove", metavar="REFERENCE", help="remove a cached model")
    models.add_argument(
        "--force", action="store_true", help="remove it even if the configuration uses it"
    )
    models.add_argument(
        "--remove-partial", metavar="ORG/REPO", help="delete a repository's partial downloads"
    )
    models.add_argument("--json", action="store_true", help="print the listing as JSON")
    settings(models)
    return parser


def _load(args: argparse.Namespace) -> LoadedConfig:
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key.strip()] = value.strip()
    flags = {
        key: getattr(args, attr, None)
        for key, attr in (
            ("server.host", "host"),
            ("server.port", "port"),
            ("backend.kind", "backend"),
            ("backend.llama.model", "model"),
            ("backend.llama.chat_template_file", "chat_template_file"),
            ("server.log_format", "log_format"),
            ("server.log_level", "log_level"),
        )
    }
    overrides.update({k: v for k, v in flags.items() if v is not None})
    return load_config(path=args.config, overrides=overrides)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        loaded = _load(args)
    except ConfigError as exc:
        print(f"wsserver: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        sys.stdout.write(describe(loaded))
        return 0
    if args.command in ("pull", "models"):
        # Imported here: huggingface_hub costs its import only when used.
        from .pull import commands

        if args.command == "pull":
            return commands.pull_command(
                args.reference, loaded.config, out=sys.stdout, err=sys.stderr
            )
        if args.remove_partial is not None:
            return commands.remove_partials_command(
                args.remove_partial, loaded.config, out=sys.stdout, err=sys.stderr
            )
        return commands.models_command(
            loaded.config,
            remove_ref=args.remove,
            force=args.force,
            as_json=args.json,
            out=sys.stdout,
            err=sys.stderr,
        )
    config = loaded.config
    if config.backend.kind == "llama" and importlib.util.find_spec("llama_cpp") is None:
        sys.stderr.write(llama_missing_message())
        return 2
    # Imported here, not at the top: ``config show`` and ``--help`` should not
    # pay for websockets, janus and prometheus_client.
    from .aio import run

    setup_logging(level=config.server.log_level, fmt=config.server.log_format)
    _raise_open_files_limit()
    try:
        return asyncio.run(run(config))
    except ConfigError as exc:
        print(f"wsserver: configuration error: {exc}", file=sys.stderr)
        return 2


def _raise_open_files_limit() -> None:
    """Lift the soft limit on open files to the hard one.

    Each connection holds a descriptor and 256 connections are allowed by
    default; the common soft limit of 1024 is shared with the model's files
    and half-open handshakes. Running out is survivable (asyncio retries the
    accept, the log is rate-limited) but should not be the first line of
    defence.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


#: Portable llama.cpp build flags: AVX2/FMA/F16C, i.e. any x86-64 CPU from 2013
#: on. scripts/install builds with the same flags (a test keeps them equal).
LLAMA_CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"


def _llama_extra() -> list[str]:
    """The pinned requirements of the ``[llama]`` extra, from the installed metadata."""
    try:
        requires = importlib.metadata.requires("wsserver") or []
    except importlib.metadata.PackageNotFoundError:  # run from a bare source tree
        requires = []
    pins = []
    for requirement in requires:
        spec, _, marker = requirement.partition(";")
        if marker.replace("'", '"').split() == ["extra", "==", '"llama"']:
            pins.append(spec.replace(" ", ""))
    return pins


def llama_missing_message() -> str:
    """What to run when the llama backend is asked for but llama-cpp-python is absent.

    A plain ``pip install llama-cpp-python`` (or ``pip install wsserver[llama]``)
    compiles llama.cpp with ``-march=native``, which is exactly the trap, so the
    message gives the portable build first and the model second.
    """
    pins = _llama_extra()
    llama = next((p for p in pins if p.startswith("llama-cpp-python")), "llama-cpp-python")
    # Quoted: a pin like ``jinja2>=3.1`` would be a shell redirection.
    others = " ".join(shlex.quote(p) for p in pins if not p.startswith("llama-cpp-python"))
    python = sys.executable or "python3"
    lines = [
        "wsserver: the llama backend needs llama-cpp-python, which is not installed",
        f"for {python}. Build it with portable CPU flags:",
        "",
        f'  CMAKE_ARGS="{LLAMA_CMAKE_ARGS}" FORCE_CMAKE=1 \\',
        f"    {python} -m pip install --no-cache-dir {llama}",
    ]
    if others:
        lines += ["", "then the default model (or set backend.llama.model to a GGUF file):", ""]
        lines += [f"  {python} -m pip install {others}"]
    lines += [
        "",
        "Why: llama-cpp-python compiles llama.cpp with -march=native by default; on",
        "CPUs with AMX that build dies with SIGILL at the first matrix multiplication,",
        "and it does not run on other CPUs. --no-cache-dir because pip's wheel cache",
        "ignores CMAKE_ARGS and would silently reuse a wheel built with other flags.",
        "The build takes 6-12 minutes on 2 cores and needs a C/C++ compiler.",
        "Step by step: docs/install.md.",
        "",
        "Or try the server without a model: wsserver serve --backend fake",
        "",
    ]
    return "\n".join(lines)
