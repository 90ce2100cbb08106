"""The GPU measurement script's plumbing, run here without torch (--dry-run): every
configuration in a fresh process, several at once, a failing, crashing or hanging run
recorded and the others measured, and compare.py's table made from what it wrote."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests import FIXTURES, ROOT

BENCH = ROOT / "benchmarks" / "memory"
MEASURED = FIXTURES / "memory"


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


measure = _module("measure_peft_bnb")
compare = _module("compare")


def test_the_sets_cover_what_the_validation_needs() -> None:
    runs = measure.select(list(measure.SETS), ["plain"])
    by_set = {name: [r for r in runs if r["set"] == name] for name in measure.SETS}
    assert len(by_set["committed"]) == 53  # the 51 committed and the 2 the budget left out
    assert len(by_set["new"]) >= 8 and len(by_set["holdout"]) == 14
    assert {r["loop"] for r in by_set["diagnose"]} == {"plain", "benchmark"}
    ids = [measure.config_id(r) + r["loop"] for r in runs if r["set"] != "diagnose"]
    assert len(ids) == len(set(ids))
    old = {measure.config_id(c) for c in measure.committed_configs() + measure.HOLDOUT_CONFIGS}
    assert not old & {measure.config_id(c) for c in measure.NEW_CONFIGS}
    for r in runs:  # every architecture is one the estimator reads
        assert compare.estimate_for(dict(r, config=measure.ARCHS[r["arch"]])).total_bytes > 0


def test_follow_up_sets_are_new_and_only_run_when_named() -> None:
    """The MoE configurations held out of the expert model repeat no measured one; neither
    follow-up set is in the default run."""
    default = measure.select(list(measure.SETS), ["plain"])
    assert not {r["set"] for r in default} & set(measure.FOLLOW_UP_SETS)
    runs = measure.select(list(measure.FOLLOW_UP_SETS), ["plain"])
    held = [r for r in runs if r["set"] == "moe-holdout"]
    assert len(held) == len(measure.MOE_HOLDOUT_CONFIGS) >= 4
    measured = {measure.config_id(c) for c in measure.MOE_CONFIGS}
    assert not measured & {measure.config_id(r) for r in held}
    growth = [r for r in runs if r["set"] == "growth"]
    assert {(r["loop"], bool(r.get("trace"))) for r in growth} == {
        ("plain", True),
        ("benchmark", False),
    }
    for r in runs:
        est = compare.estimate_for(dict(r, config=measure.ARCHS[r["arch"]]))
        assert 0 < est.total_bytes < measure.rough_peak_bytes(r)


def test_the_steady_state_is_the_largest_step_from_the_second() -> None:
    steps = [
        dict(step=1, peak_reserved=100, peak_allocated=90, outside=10),
        dict(step=2, peak_reserved=120, peak_allocated=95, outside=10),
        dict(step=3, peak_reserved=110, peak_allocated=95, outside=12),
    ]
    totals = measure._totals(steps)
    assert totals["measured_total"] == 130 and totals["steady_step"] == 2
    assert measure._totals(steps[:1])["measured_total"] is None


def test_a_dry_run_survives_failing_runs(tmp_path: Path) -> None:
    configs = [
        dict(arch="tiny", layers=2, batch=1, seq=128, gc=True),
        dict(arch="qwen3-0.6b", layers=28, batch=1, seq=512, gc=False, loop="benchmark"),
        dict(arch="tiny", layers=2, batch=2, seq=128, gc=True, dry_fail="raise"),
        dict(arch="tiny", layers=2, batch=3, seq=128, gc=True, dry_fail="crash"),
        dict(arch="tiny", layers=2, batch=4, seq=128, gc=True, dry_fail="hang"),
    ]
    listing = tmp_path / "configs.json"
    listing.write_text(json.dumps(configs))
    out = tmp_path / "out"
    t0 = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / "measure_peft_bnb.py"),
            "--out",
            str(out),
            "--configs",
            str(listing),
            "--dry-run",
            "--timeout-s",
            "3",
            "--ckpt-root",
            str(tmp_path / "ckpt"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - t0 < 60
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == len(configs)
    errors = {r["batch"]: r.get("error", "") for r in records if r["arch"] == "tiny"}
    assert errors[1] == ""
    assert "RuntimeError" in errors[2]
    assert "exit code 3" in errors[3]
    assert errors[4].startswith("timeout")
    good = [r for r in records if "error" not in r]
    assert len(good) == 2, good
    assert all(len(r["steps"]) == 4 and r["measured_total"] > 0 for r in good), good
    assert json.loads((out / "environment.json").read_text())["dry_run"] is True

    table = compare.rows(out / "results.jsonl")
    assert len(table) == len(configs)
    assert sum("error" in r for r in table) == 3
    assert all(r["protocol"] == "dry run" for r in table)
    text = compare.render(table)
    assert "FAILED" in text and "custom (dry run): 2 runs" in text
    assert compare.main(["--measured", str(out / "results.jsonl"), "--write", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "comparison.json").read_text())[0]["arch"] == "tiny"
    assert (tmp_path / "comparison.csv").read_text().startswith("arch,")


def test_a_configuration_two_sets_measure_gets_two_run_ids() -> None:
    """The diagnose pair is in the committed set too: each copy writes its own run file and
    compare.py keeps both records."""
    runs = measure.select(["diagnose", "committed"], ["plain"])
    for c in runs:
        c["run"] = f"{measure.config_id(c)}-{c['loop']}"
    measure.unique_run_ids(runs)
    ids = [c["run"] for c in runs]
    assert len(ids) == len(set(ids))
    assert "llama-3.2-1b-L16-b1-s512-gc1-plain-diagnose" in ids
    assert "llama-3.2-1b-L16-b1-s512-gc1-plain-committed" in ids
    assert "llama-3.2-1b-L16-b2-s512-gc1-plain" in ids  # measured once: its id is unchanged


def test_compare_keeps_both_sets_and_the_last_record_of_a_run(tmp_path: Path) -> None:
    base = json.loads((MEASURED / "results.jsonl").read_text().splitlines()[0])
    lines = [
        dict(base, set="committed", run="x", measured_total=1),
        dict(base, set="diagnose", run="x", measured_total=2),
        dict(base, set="committed", run="x", measured_total=3),  # measured again, alone
    ]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    kept = {(r["set"], r["measured_total"]) for r in compare.records(path)}
    assert kept == {("committed", 3), ("diagnose", 2)}


@pytest.mark.parametrize("name", ["measured.jsonl", "holdout.jsonl"])
def test_old_protocol_rows_are_recomputed_and_marked(name: str) -> None:
    table = compare.rows(MEASURED / "old-protocol" / name)
    assert table and all(
        r["protocol"] == "old protocol" and r["loop"] == "benchmark" for r in table
    )
    assert all(abs(r["error_total"]) <= compare.TOLERANCE for r in table)


def test_the_measured_runs_are_kept_once_as_the_tests_fixtures() -> None:
    """The runs the scripts measured live in tests/fixtures/memory (what the tests read, and
    compare.py by default); benchmarks/memory/results holds only what compare.py derives
    from them. No file is kept twice."""
    for name in ("results.jsonl", "old-protocol/measured.jsonl", "old-protocol/holdout.jsonl"):
        assert (MEASURED / name).is_file(), name
    assert len(list((MEASURED / "traces").glob("*.json.gz"))) == 16
    assert {p.name for p in (MEASURED / "nybble").glob("*.jsonl")} == {"dev.jsonl", "holdout.jsonl"}
    assert compare.MEASURED == MEASURED
    derived = [p for p in (BENCH / "results").rglob("*") if p.is_file()]
    assert derived and all(p.stem == "comparison" for p in derived), derived
    fixtures = {p.read_bytes() for p in MEASURED.rglob("*") if p.is_file()}
    assert not any(p.read_bytes() in fixtures for p in derived)
