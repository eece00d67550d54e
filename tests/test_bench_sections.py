"""The harness's report without measuring: sections 18 and 19 on results
written out here, recorded sections, ``--merge``, and the guard that keeps
hand-written text from being lost by the next report.

Nothing here starts a server; the sections' runs have their smoke tests in
tests/test_bench_smoke.py.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import analysis, embeddings, paired, report, speculation  # noqa: E402
from bench.options import Options  # noqa: E402

DOCS = ROOT / "docs" / "benchmarks.md"
UNIT = float(os.environ.get("WSSERVER_TEST_UNIT", "1.0"))


def met(targets: list[dict[str, Any]], start: str) -> bool | None:
    """Whether the one target whose name starts with ``start`` was met."""
    (found,) = [t for t in targets if t["name"].startswith(start)]
    value: bool | None = found["met"]
    return value


# ---------------------------------------------------------------- section 18


def embeddings_result(ratios: dict[str, float | None]) -> dict[str, Any]:
    """Section 18's result with these workloads' ratios (None: llama-server not measured)."""
    rows = []
    for name, r in ratios.items():
        ours = {
            "inputs_s": 10.0,
            "tokens_s": 150.0,
            "tokens": 15,
            "rounds_inputs_s": [10.0],
            "body_ms": 8.0,
        }
        peer = (
            None
            if r is None
            else {**ours, "inputs_s": 10.0 / r, "rounds_inputs_s": [10 / r], "body_ms": 2.0}
        )
        rows.append(
            {
                "workload": name,
                "inputs": int(name.split()[0]),
                "ours": ours,
                "peer": peer,
                "ratio": r,
                "max_unit_diff": None if r is None else 0.017,
            }
        )
    gaps = [
        {"inputs": 512, "embed_s": 120.5, "worst_gap_ms": w, "median_gap_ms": 60.2}
        for w in (164.0, 230.0)
    ]
    return {
        "status": "ok",
        "threads": 2,
        "model": "gemma-3-270m-q4_k_m.gguf",
        "rounds": 3,
        "rows": rows,
        "gaps": gaps,
        "plain_llama_server_embeddings_status": 501,
    }


FULL = {"1 short": 1.0, "32 short": 1.05, "512 short": 0.99, "8 long": 0.81}


def test_section_18_targets_are_issue_37s_one_a_workload_and_the_gap() -> None:
    result = embeddings_result(FULL)
    found = embeddings.targets(result)
    assert [t["name"] for t in found] == [
        *(f"embeddings, {name}: inputs/s >= 1.0\u00d7 llama-server's" for name in FULL),
        "embeddings: three streams' worst gap <= 250 ms beside 512 inputs (every round)",
    ]
    assert [t["met"] for t in found] == [True, True, False, False, True]
    assert [t["shown"] for t in found] == [
        *("1.00\u00d7", "1.05\u00d7", "0.99\u00d7", "0.81\u00d7"),
        "230 ms",  # the worst round's
    ]
    result["gaps"][0]["worst_gap_ms"] = 251.0
    assert embeddings.targets(result)[-1]["met"] is False
    # Without llama-server its ratios are not measured; the gap (ours alone) is.
    *missing, gap = embeddings.targets(embeddings_result(dict.fromkeys(FULL)))
    assert {t["shown"] for t in missing} == {"not measured"}
    assert {t["met"] for t in missing} == {None}
    assert gap["met"] is True


def test_section_18_renders_the_tables_the_hand_text_had() -> None:
    result = embeddings_result(FULL)
    text = embeddings.render(result)
    assert (
        "| inputs | wsserver inputs/s | llama-server inputs/s | **ratio** | wsserver tokens/s "
        "| llama-server tokens/s | answer's body, head to last byte: ms, wsserver / llama-server "
        "| max \\|Δ\\| of unit vectors |"
    ) in text
    assert "| 512 short | 10.0 | 10.1 | **0.99\u00d7** | 150 | 150 | 8 / 2 | 1.7e-02 |" in text
    assert "| 8 long inputs/s" not in text  # the targets' rows name the workload once each
    assert (
        "| embeddings, 8 long: inputs/s >= 1.0\u00d7 llama-server's | 0.81\u00d7 | **no** |" in text
    )
    assert "without it answered `/v1/embeddings` with 501" in text
    assert "| 2 | 60.2 | **230** | 120.50 |" in text
    (headline,) = embeddings.headlines(result)
    assert headline.startswith("| embeddings vs llama-server `--embeddings` (section 18) |")
    assert "1.00\u00d7 / 1.05\u00d7 / 0.99\u00d7 / 0.81\u00d7" in headline
    assert "worst gap 164\u2013230 ms" in headline
    # Without llama-server: its columns are dashes and the reason is said.
    alone = embeddings.render(embeddings_result(dict.fromkeys(FULL)))
    assert "| 1 short | 10.0 | - | **-** | 150 | - | 8 / - | - |" in alone
    assert "llama-server: not measured" in alone


def test_section_18_quick_workloads_are_named_by_their_counts() -> None:
    full, quick = embeddings.workloads(False), embeddings.workloads(True)
    assert list(full) == ["1 short", "32 short", "512 short", "8 long"]
    assert [len(v) for v in full.values()] == [1, 32, 512, 8]
    assert [len(v) for v in quick.values()] == [int(k.split()[0]) for k in quick]
    assert all(len(text) <= 300 for text in quick[next(k for k in quick if "long" in k)])


# ---------------------------------------------------------------- section 19


def speculation_result(
    copy_auto: float, prose_auto: float, *, peers: bool = True, same: bool = True
) -> dict[str, Any]:
    """Section 19's result: wsserver off at 50 tok/s on both, ``auto`` at
    these, llama-server's modes at 60 (copy) and 70 (prose)."""
    rates = {
        speculation.AUTO: (copy_auto, prose_auto),
        speculation.OFF: (50.0, 50.0),
        speculation.PEER: (52.0, 55.0),
        "llama-server `--spec-type ngram-simple`": (60.0, 70.0),
        "llama-server `--spec-type ngram-map-k`": (58.0, 66.0),
        "llama-server `--spec-type ngram-cache`": (51.0, 54.0),
    }
    rows = []
    for name, (c, p) in rates.items():
        ours = not name.startswith("llama")
        for kind, rate in (("copy", c), ("prose", p)):
            if not (ours or peers):
                rows.append({"contender": name, "kind": kind, "measured": False})
                continue
            parted = name == speculation.AUTO and kind == "copy" and not same
            row = {
                "contender": name,
                "kind": kind,
                "measured": True,
                "tok_s": rate,
                "rounds_tok_s": [rate],
                "tokens": 300,
                "drafted": (120 if name == speculation.AUTO else 0) if ours else None,
                "accepted": (90 if name == speculation.AUTO else 0) if ours else None,
                "same_text": not parted,
                "parted_at": 212 if parted else None,
            }
            if parted:
                row["parted"] = {"with": "    return round(total)", "without": "    return x"}
            rows.append(row)
    return {
        "status": "ok",
        "threads": 2,
        "model": "gemma-3-270m-q4_k_m.gguf",
        "rounds": 2,
        "max_tokens": 300,
        "rows": rows,
    }


def test_section_19_targets_are_issue_40s_and_the_same_text() -> None:
    found = speculation.targets(speculation_result(75.0, 48.5))
    # copy 1.5x ours off (75 / 50) and 1.25x ngram-simple (75 / 60); prose 0.97x.
    assert met(found, "speculation, copy: >= 1.5") is True
    assert met(found, "speculation, copy: >= 1.0") is True
    assert met(found, "speculation, prose") is True
    assert met(found, "speculation: the greedy text") is True
    found = speculation.targets(speculation_result(74.5, 48.4, same=False))
    assert met(found, "speculation, copy: >= 1.5") is False
    assert met(found, "speculation, prose") is False
    assert met(found, "speculation: the greedy text") is False
    (same,) = [t for t in found if t["name"].startswith("speculation: the greedy")]
    assert same["shown"] == "copy no, prose yes"
    # Below llama-server's best n-gram mode (60 tok/s), not its others.
    found = speculation.targets(speculation_result(59.0, 50.0))
    assert met(found, "speculation, copy: >= 1.0") is False
    # Without llama-server that target is not measured; ours still are.
    found = speculation.targets(speculation_result(80.0, 50.0, peers=False))
    assert met(found, "speculation, copy: >= 1.0") is None
    assert met(found, "speculation, copy: >= 1.5") is True


def test_section_19_renders_rates_ratios_drafts_and_the_text() -> None:
    result = speculation_result(81.5, 41.5, same=False)
    text = speculation.render(result)
    assert (
        '| wsserver, `speculative = "auto"` | 81.5 | 1.63\u00d7 | 120 / 90 '
        "| **no** (from character 212) | 41.5 | 0.83\u00d7 | 120 / 90 | yes |"
    ) in text
    assert "| llama-server `--spec-type ngram-simple` | 60.0 | 1.20\u00d7 | - | yes |" in text
    (headline,) = speculation.headlines(result)
    assert "copy: `auto` 81.5 tok/s against `off` 50.0 (1.63\u00d7)" in headline
    assert "best n-gram mode, `--spec-type ngram-simple`: 60.0 tok/s, 1.36\u00d7" in headline
    assert "prose: 0.83\u00d7" in headline and "copy no, prose yes" in headline
    (note,) = speculation.notes(result)
    assert "character 212" in note and '"    return x"' in note
    assert speculation.notes(speculation_result(81.5, 50.0)) == []
    alone = speculation.render(speculation_result(81.5, 50.0, peers=False))
    assert "| llama-server, none | not measured |" in alone


def test_a_text_parts_where_it_first_differs() -> None:
    assert speculation._parted_at("abc", "abc") is None
    assert speculation._parted_at("abd", "abc") == 2
    assert speculation._parted_at("ab", "abc") == 2


# ---------------------------------------------------------------- paired rounds


def test_paired_rounds_alternate_who_goes_first_and_pair_the_figures() -> None:
    """``bench.paired``: wsserver first in odd rounds, llama-server in even ones;
    the summary reads each pair's ratio, not the sides' pooled figures."""
    order: list[str] = []

    async def side(name: str, value: float) -> float:
        order.append(name)
        return value

    ours, peer = asyncio.run(
        paired._alternate(3, lambda r: side("ours", 10.0 + r), lambda r: side("peer", 10.0))
    )
    assert order == ["ours", "peer", "peer", "ours", "ours", "peer"]
    assert ours == [10.0, 11.0, 12.0] and peer == [10.0, 10.0, 10.0]
    faster = paired.pairs_summary([9.0, 11.0, 10.5], [10.0, 10.0, 10.0], higher_is_better=True)
    assert "median of the pairs' ratios 1.050" in faster
    assert "ratio of the medians 1.050" in faster and "ahead in 2 of 3" in faster
    seconds = paired.pairs_summary([7.2, 7.4], [7.3, 7.1], higher_is_better=False)
    assert "ahead in 1 of 2" in seconds  # fewer seconds is ahead


# ---------------------------------------------------------------- the report


RECORDED = {
    "status": "recorded",
    "measured": "2026-12-03",
    "command": "python -m bench.embeddings --rounds 3",
    "headline": ["embeddings vs llama-server (section 18)", "0.92\u00d7 by hand"],
    "markdown": "A paragraph written by hand.\n\n| a | b |\n|---|---|\n| 1 | 2 |",
}


def meta() -> dict[str, Any]:
    return {
        "date": "2026-12-04 00:00 UTC",
        "commit": "0" * 40,
        "command": "python -m bench",
        "quick": False,
        "sections": [],
        "machine": {"nproc": 2},
        "notes": [],
        "json_name": "benchmarks.json",
    }


def test_a_recorded_section_renders_its_text_marked_and_its_summary_row() -> None:
    results = {"embeddings": copy.deepcopy(RECORDED)}
    opts = Options(out=Path("benchmarks.md"))
    text = report.markdown(results, meta(), opts, {}, "bench")
    assert (
        "| embeddings vs llama-server (section 18) | 0.92\u00d7 by hand (measured 2026-12-03 by "
        "`python -m bench.embeddings --rounds 3`, before the section was in the harness) |"
    ) in text
    section = text.split("## 18. Embeddings beside llama-server `--embeddings` (issue 37)")[1]
    assert section.startswith(
        "\n\n*Measured on 2026-12-03 by `python -m bench.embeddings --rounds 3`, before this "
        "section was part of the harness"
    )
    assert "A paragraph written by hand.\n\n| a | b |\n|---|---|\n| 1 | 2 |\n" in section
    # Neither "not measured" nor targets for it: its text says what it measured.
    assert "not measured" not in text
    assert analysis.targets(results) == []


def test_a_registered_section_without_results_renders_nothing() -> None:
    assert "speculation" in analysis.BY_KEY and "embeddings" in analysis.BY_KEY
    numbers = [s.number for s in analysis.SECTIONS]
    assert "18" in numbers and "19" in numbers
    text = report.markdown({}, meta(), Options(), {}, "bench")
    assert "## 18." not in text and "## 19." not in text and "section 19" not in text


def test_merge_keeps_figures_and_recorded_text_a_run_did_not_measure() -> None:
    old_ok = {"status": "ok", "rows": []}
    old = {
        "meta": {**meta(), "merged": []},
        "results": {"freeze": old_ok, "embeddings": RECORDED, "templates": old_ok},
    }
    new = {
        "freeze": {"status": "failed", "reason": "boom"},
        "embeddings": {"status": "skipped", "reason": "no llama-server"},
        "templates": {"status": "ok", "rows": [1]},
        "speculation": {"status": "skipped", "reason": "no model"},
    }
    run_meta = {
        **meta(),
        "sections": ["freeze", "embeddings", "templates", "speculation"],
        "loadavg_before": "0 0 0",
        "loadavg_after": "0 0 0",
    }
    results, merged, kept = report.merge(new, run_meta, old)
    assert kept == ["freeze", "embeddings"]
    assert results["freeze"] is old_ok and results["embeddings"] is RECORDED
    assert results["templates"] == {"status": "ok", "rows": [1]}
    # A section the JSON did not have yet says why it is not measured.
    assert results["speculation"]["status"] == "skipped"
    assert merged["merged"][-1]["sections"] == ["templates", "speculation"]
    # A measured section replaces recorded text.
    measured = {"status": "ok", "rows": []}
    results, _, kept = report.merge({"embeddings": measured}, run_meta, old)
    assert kept == [] and results["embeddings"] is measured


def write_report(tmp_path: Path) -> Path:
    results = {"embeddings": copy.deepcopy(RECORDED), "speculation": speculation_result(80, 50)}
    out = tmp_path / "benchmarks.md"
    report.write(results, meta(), Options(out=out))
    return out


def test_hand_text_is_found_and_generated_text_is_not(tmp_path: Path) -> None:
    out = write_report(tmp_path)
    opts = Options(out=out)
    assert report.hand_text(opts) == []
    # A figure read from the code may change between two reports: not hand text.
    text = out.read_text()
    out.write_text(
        text.replace("| speculation, copy: >= 1.5\u00d7", "| speculation, copy: >= 2.5\u00d7")
    )
    assert report.hand_text(opts) == []
    # Nor is the header of a --quick run merged into it (its meta keeps the first run's).
    header = "Generated by `python -m bench` on 2026-12-04 00:00 UTC at commit `" + "0" * 40 + "`"
    assert header + "." in text
    out.write_text(
        text.replace(
            header + ".", header + " — **quick mode: smoke-test figures, not for comparison**."
        )
    )
    assert report.hand_text(opts) == []
    # A paragraph and a summary row written in by hand are.
    hand = text.replace(
        "## Machine", "A finding written by hand.\n\n| a hand row | 3 |\n\n## Machine"
    )
    out.write_text(hand)
    assert report.hand_text(opts) == ["A finding written by hand.", "| a hand row | 3 |"]
    # So is all of a report without its JSON.
    out.with_suffix(".json").unlink()
    assert len(report.hand_text(opts)) == len([x for x in hand.splitlines() if x.strip()])


@pytest.mark.timeout(int(60 * UNIT))
def test_the_harness_stops_before_it_would_lose_hand_text(tmp_path: Path) -> None:
    out = write_report(tmp_path)
    out.write_text(out.read_text() + "\nA note written by hand.\n")
    command = [sys.executable, "-m", "bench", "--render-only", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSSERVER_")}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "A note written by hand." in proc.stderr and "--drop-hand-text" in proc.stderr
    assert "A note written by hand." in out.read_text()  # nothing written
    proc = subprocess.run(
        [*command, "--drop-hand-text"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "A note written by hand." not in out.read_text()
    assert report.hand_text(Options(out=out)) == []


def test_the_committed_report_has_no_text_its_json_does_not_give() -> None:
    """docs/benchmarks.md is what the harness writes from docs/benchmarks.json
    (numbers aside): the next ``--merge`` loses nothing."""
    assert report.hand_text(Options(out=DOCS)) == []
    data = json.loads(DOCS.with_suffix(".json").read_text())
    assert data["results"]["embeddings"]["status"] == "ok" or analysis.recorded(
        data["results"]["embeddings"]
    )
    assert "## 18. Embeddings beside llama-server `--embeddings` (issue 37)" in DOCS.read_text()


def test_without_matplotlib_a_result_keeps_the_plots_drawn_from_it(tmp_path: Path) -> None:
    """A report written where matplotlib is missing links the plots an earlier
    run drew from the same result; a re-measured result (no ``plots``) none."""
    try:
        import matplotlib  # noqa: F401

        pytest.skip("matplotlib is installed: plots are drawn, not kept")
    except ImportError:
        pass
    results = {
        "ceiling": {"status": "ok", "plots": ["ceiling.png"]},
        "slow": {"status": "ok"},
        "cancel": {"status": "failed", "plots": ["cancel.png"]},
    }
    assert report.write_plots(results, tmp_path) == {"ceiling": ["ceiling.png"]}
    data = json.loads(DOCS.with_suffix(".json").read_text())
    assert data["results"]["ceiling"]["plots"] == ["ceiling.png"]
    assert "![3. Server ceiling (fake backend, unlimited rate)](bench/ceiling.png)" in (
        DOCS.read_text()
    )
