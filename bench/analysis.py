"""The sections, and what their figures say: the summary, the targets, the problems.

A section is a module with ``run`` (its measurement) and ``render`` (its part
of docs/benchmarks.md), and where it has them ``headlines`` (its rows of the
summary table), ``targets``, ``notes`` (paragraphs under its table), ``problems``
(findings a reader of the summary must see) and ``plot``. All of it is
written from the results, so a re-run cannot leave stale explanations behind:
each note is written only when the figures call for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from . import (
    adversaries,
    batched,
    cancel,
    ceiling,
    conversations,
    embeddings,
    freeze,
    idle,
    images,
    models,
    openai_sse,
    page,
    responses,
    resume,
    slow,
    speculation,
    structured,
    templates,
    throughput,
    upstream,
)
from .figures import paragraphs, target_rows


@dataclass(frozen=True)
class Section:
    key: str
    title: str
    module: ModuleType
    #: ``lineup``: takes turns on the llama contenders of sections 1, 2 and 8
    #: (``run(opts, lineup)``); ``fake``: the fake engine, run first; ``llama``:
    #: loads a model of its own, and may skip itself (``run(opts)`` both).
    runs_on: Literal["lineup", "fake", "llama"]
    #: What the run log says when it starts.
    what: str = ""

    @property
    def number(self) -> str:
        return self.title.split(".", 1)[0]


SECTIONS = (
    Section("throughput", "1. Throughput and time to first token", throughput, "lineup"),
    Section("cancel", "2. Cancel latency", cancel, "lineup"),
    Section("ceiling", "3. Server ceiling (fake backend, unlimited rate)", ceiling, "fake"),
    Section("slow", "4. Slow consumers", slow, "fake"),
    Section("idle", "5. Memory per idle connection", idle, "fake"),
    Section("page", "6. The chat page in Chromium (markdown, scripted input)", page, "fake"),
    Section(
        "adversaries",
        "7. Adversarial clients: memory under a ping flood and maximal frames",
        adversaries,
        "fake",
    ),
    Section(
        "openai",
        "8. The OpenAI API over SSE: wsserver, llama_cpp.server, llama-server",
        openai_sse,
        "lineup",
    ),
    Section(
        "upstream",
        "9. The openai backend: relay overhead, cancel, relay ceiling (llama-server and a fast upstream)",
        upstream,
        "fake",
    ),
    Section(
        "batched",
        "10. The batched llama engine: many streams in one context",
        batched,
        "llama",
        "the batched llama engine vs llama.cpp's tools",
    ),
    Section(
        "resume",
        "11. Resumable streams: bytes kept per detached request, time to resume",
        resume,
        "fake",
    ),
    Section(
        "structured",
        "12. The sampler chain and structured output: the default chain's cost, JSON schemas "
        "against llama-server",
        structured,
        "llama",
        "the sampler chain and JSON schemas (issue 22)",
    ),
    Section(
        "responses",
        "13. The Responses API: five turns four ways (previous_response_id over HTTP and in "
        "WebSocket mode, the whole history, our protocol), and the wire's overhead",
        responses,
        "llama",
        "five turns four ways, and the Responses wire's overhead",
    ),
    Section(
        "models",
        "14. Several models: time to first token loaded, on demand and after an eviction; "
        "memory before and after an unload",
        models,
        "llama",
        "TTFT loaded, on demand, after an eviction; memory (issue 23)",
    ),
    Section(
        "freeze",
        "15. The freeze table: a long prompt arrives while three streams decode (issue 28)",
        freeze,
        "llama",
        "a long prompt beside three decoding streams (issue 28)",
    ),
    Section(
        "templates",
        "16. Bounded chat templates: a render in a worker process against one in-process "
        "(issue 34)",
        templates,
        "fake",
        "a chat template's render in a worker process against one in-process (issue 34)",
    ),
    Section(
        "conversations",
        "17. Six conversations on two slots: a returning conversation's time to first token "
        "(issue 40)",
        conversations,
        "llama",
        "six conversations on two slots, the prompt cache in host memory (issue 40)",
    ),
    Section(
        "embeddings",
        "18. Embeddings beside llama-server `--embeddings` (issue 37)",
        embeddings,
        "llama",
        "embeddings beside llama-server --embeddings (issue 37)",
    ),
    Section(
        "speculation",
        "19. Speculative decoding beside llama-server's n-gram modes (issue 40)",
        speculation,
        "llama",
        "n-gram drafts on copying and on prose, beside llama-server's (issue 40)",
    ),
    Section(
        "images",
        "20. Images: an image's encode and first token, three streams beside it (issue 39)",
        images,
        "llama",
        "an image's encode and first token, three streams beside it (issue 39)",
    ),
)
BY_KEY = {section.key: section for section in SECTIONS}
#: The summary table's rows come in this order (section 11's after 14's), then
#: the other sections' in theirs.
HEADLINES = (
    "throughput", "cancel", "ceiling", "slow", "idle", "page", "openai", "upstream",
    "batched", "structured", "responses", "models", "resume",
)  # fmt: skip


def ok(result: dict[str, Any] | None) -> bool:
    return bool(result) and result.get("status") == "ok"  # type: ignore[union-attr]


def recorded(result: dict[str, Any] | None) -> bool:
    """A section's text kept as it was written, from a measurement made
    before the harness ran that section (``status: recorded``: ``measured``,
    ``command``, ``headline`` — the summary row's two cells — and
    ``markdown``). It stays in docs/benchmarks.json, so that every report
    written from it has the text, until the harness measures the section."""
    return bool(result) and result.get("status") == "recorded"  # type: ignore[union-attr]


def recorded_preface(key: str, result: dict[str, Any]) -> str:
    """The line above a recorded section's text: when, by what, not by the harness."""
    return (
        f"*Measured on {result['measured']} by `{result['command']}`, before this section was "
        "part of the harness: its text as written then, kept in benchmarks.json until "
        f"`python -m bench --sections {key} --merge` measures it.*"
    )


def _summary_order() -> list[str]:
    return [*HEADLINES, *(key for key in BY_KEY if key not in HEADLINES)]


def _parts(name: str, results: dict[str, Any], keys: Any = None) -> list[Any]:
    """Each measured section's ``name`` (summary, targets, …) applied to its result."""
    out: list[Any] = []
    for key in keys or BY_KEY:
        write = getattr(BY_KEY[key].module, name, None)
        if write is not None and ok(results.get(key)):
            out += write(results[key])
    return out


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for section in SECTIONS:
        result = results.get(section.key)
        if not hasattr(section.module, "targets") or result is None or recorded(result):
            continue
        if ok(result):
            out += section.module.targets(result)
        else:
            out.append({"name": f"section {section.key}", "shown": "not measured", "met": None})
    return out


def summary(results: dict[str, Any]) -> list[str]:
    lines = ["| measure | result |", "|---|---|"]
    for key in _summary_order():
        result = results.get(key)
        if result is None:
            continue
        if ok(result):
            lines += _parts("headlines", results, [key])
        elif recorded(result):
            measure, value = result["headline"]
            lines.append(
                f"| {measure} | {value} (measured {result['measured']} by `{result['command']}`, "
                "before the section was in the harness) |"
            )
    for key, result in results.items():
        if result.get("status") not in ("ok", "recorded"):
            lines.append(f"| section {key} | not measured: {result.get('reason', '?')} |")
    found = targets(results)
    lines += ["", "### Targets", "", "| target | result | met |", "|---|---|:-:|"]
    lines += [*target_rows(found), ""]
    if any(t.get("met") is False for t in found):
        lines.append(
            "Missed targets are explained under their sections below, with what would close them."
        )
    elif found:
        lines.append("Every target that was measured was met.")
    problems = _parts("problems", results)
    if problems:
        lines += ["", "### Problems found", "", *(f"- {p}" for p in problems)]
        lines += ["", "Each is explained under its section below, with what would close it."]
    return lines


def section_notes(key: str, results: dict[str, Any]) -> list[str]:
    """The paragraphs under a section's table."""
    return paragraphs(_parts("notes", results, [key]))


def method_notes() -> list[str]:
    return [
        "## Method notes",
        "",
        "- Medians over repeats, with p99 (for a handful of repeats, the worst) for latencies; "
        "throughput ratios and TTFT differences are taken per repeat against the in-process run of the "
        "same prompt, then the median, so machine drift between repeats cancels out.",
        "- Temperature 0 (greedy) and the same prompts for every contender; `repeat_penalty = 1.0` is sent "
        "to llama_cpp.server explicitly (its default is 1.1, `create_completion`'s is 1.0). The harness "
        "checks that every contender's text equals the in-process text.",
        "- wsserver runs in its own process (`bench/probe_server.py`) so that clients never share its event "
        "loop or GIL; that wrapper adds a 10 ms loop-lag probe and, in section 4, a 50 ms buffer sampler. "
        "The fake-backend sections lift the per-IP connection limit, the total connection limit and the "
        "client frame-rate limit (`limits.*`), which a load test from one address would otherwise hit.",
        "- The fake-backend load client (`bench/wsload.py`) counts frames instead of validating them so "
        "that the client is not the bottleneck; its CPU use is reported next to the server's.",
    ]
