"""The estimator's `framework="nybble"` (nybble's own GPU trainer): the CuPy pool simulation's
rules, the pool against the allocation traces measured on an H100, the estimates against the
measured runs (development and held-out sets, tests/fixtures/memory/nybble/), the
settings it refuses, and what any estimate must satisfy."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from nybble.cli import main
from nybble.memory import MODEL_PRESETS, TrainingSetup, estimate_memory
from nybble.memory import nybble_timeline as nt
from nybble.memory.cupy_pool import CupyPool, round_size

RESULTS = Path(__file__).resolve().parent / "fixtures" / "memory" / "nybble"
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "memory"
MiB = 1 << 20


def measured(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (RESULTS / name).read_text().splitlines()]


def estimate_of(config: dict[str, Any]) -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        from measure_nybble import estimate
    finally:
        sys.path.pop(0)
    return estimate(config)


# --- the pool's rules ------------------------------------------------------------------


def test_requests_round_to_512_and_a_miss_reserves_exactly_the_request() -> None:
    pool = CupyPool()
    assert round_size(1) == round_size(512) == 512 and round_size(513) == 1024
    a = pool.malloc(1000)
    assert pool.block_size(a) == 1024 and pool.reserved == pool.allocated == 1024
    pool.malloc(3 * MiB + 1)
    assert pool.reserved == 1024 + 3 * MiB + 512


def test_freed_chunks_are_reused_best_fit_and_split() -> None:
    pool = CupyPool()
    big, small = pool.malloc(4 * MiB), pool.malloc(1 * MiB)
    pool.free(big)
    pool.free(small)
    reserved = pool.reserved
    x = pool.malloc(MiB // 2)  # the 1 MiB chunk is the best fit: split, the 4 MiB left whole
    y = pool.malloc(4 * MiB)
    assert pool.reserved == reserved
    pool.malloc(MiB // 2)  # the other half of the 1 MiB chunk
    assert pool.reserved == reserved
    pool.malloc(1024)  # nothing free is left
    assert pool.reserved == reserved + 1024
    pool.free(x)
    pool.free(y)
    assert pool.allocated == MiB // 2 + 1024


def test_split_chunks_merge_back_but_blocks_never_do() -> None:
    pool = CupyPool()
    whole = pool.malloc(2 * MiB)
    pool.free(whole)
    a, b = pool.malloc(MiB), pool.malloc(MiB)  # both halves of the one block
    assert pool.reserved == 2 * MiB
    pool.free(a)
    pool.free(b)
    pool.malloc(2 * MiB)  # merged again: fits without a new block
    assert pool.reserved == 2 * MiB
    other = CupyPool()
    c, d = other.malloc(MiB), other.malloc(MiB)  # two blocks side by side
    other.free(c)
    other.free(d)
    other.malloc(2 * MiB)
    assert other.reserved == 4 * MiB


def test_empty_cache_returns_whole_free_blocks_only() -> None:
    pool = CupyPool()
    a = pool.malloc(MiB)
    pool.free(a)
    whole = pool.malloc(2 * MiB)
    pool.free(whole)
    kept = pool.malloc(3 * MiB // 2)  # a split of the 2 MiB block: that block stays
    pool.empty_cache()  # the 1 MiB block goes
    assert pool.reserved == 2 * MiB
    pool.free(kept)
    pool.empty_cache()
    assert pool.reserved == 0


def test_the_pool_replays_measured_traces_to_the_byte() -> None:
    """Every allocation and free of real training runs (setup and three steps), measured by
    measure_nybble.py --trace on an H100, through the simulation: each step's allocated and
    reserved peaks are CuPy's own (the 512 bytes: the recorder starts after one array)."""
    runs = {r["name"]: r for r in measured("dev.jsonl")}
    traces = sorted((RESULTS / "traces").glob("*.json.gz"))
    assert len(traces) == 4
    for path in traces:
        run = runs[path.name.removesuffix(".json.gz")]
        events = json.loads(gzip.decompress(path.read_bytes()))
        pool, handles, step, peaks = CupyPool(), {}, 0, {}
        pool.malloc(1)
        for op, ptr, size, at, _site in events:
            if at != step:
                peaks[step] = (pool.peak_allocated, pool.peak_reserved)
                step = at
                pool.reset_peak_stats()
            if op == "a":
                handles[ptr] = pool.malloc(size)
            else:
                pool.free(handles.pop(ptr))
        peaks[step] = (pool.peak_allocated, pool.peak_reserved)
        for s in run["steps"]:
            allocated, reserved = peaks[s["step"]]
            assert allocated == s["peak_allocated"] + 512
            assert s["peak_reserved"] <= reserved <= s["peak_reserved"] + 512


# --- the estimates against the measured runs --------------------------------------------


@pytest.mark.parametrize("results", ["dev.jsonl", "holdout.jsonl"])
def test_estimates_match_the_measured_runs(results: str) -> None:
    """Reserved peak within 0.1% and the total (with NVML's outside part) within 2% on every
    run; the issue's bar is 5%. The held-out runs were measured after the model was written."""
    runs = measured(results)
    assert len(runs) >= 4 and all("error" not in r for r in runs)
    for run in runs:
        est = estimate_of(run["config"])
        assert est.framework == "nybble"
        assert abs(est.reserved_peak_bytes / run["peak_reserved"] - 1) < 1e-3, run["name"]
        assert abs(est.allocated_peak_bytes / run["peak_allocated"] - 1) < 5e-3, run["name"]
        assert abs(est.total_bytes / run["total"] - 1) < 0.02, run["name"]


# --- what every estimate satisfies ---------------------------------------------------------


def test_breakdown_adds_up_and_settings_move_it_the_right_way() -> None:
    base = estimate_memory("qwen3-0.6b", seq_len=1024, framework="nybble")
    assert sum(base.breakdown.values()) == base.total_bytes
    assert base.allocated_peak_bytes <= base.reserved_peak_bytes < base.total_bytes
    assert base.breakdown["quantized_weights"] > 0 and base.breakdown["optimizer_states"] > 0
    assert base.peak_phase in base.phases
    longer = estimate_memory("qwen3-0.6b", seq_len=4096, framework="nybble")
    no_gc = estimate_memory(
        "qwen3-0.6b", seq_len=1024, grad_checkpointing=False, framework="nybble"
    )
    wider = estimate_memory("qwen3-0.6b", seq_len=1024, lora_r=128, framework="nybble")
    dense = estimate_memory("qwen3-0.6b", seq_len=1024, quant="bfloat16", framework="nybble")
    for bigger in (longer, no_gc, wider, dense):
        assert bigger.total_bytes > base.total_bytes
    torch = estimate_memory("qwen3-0.6b", seq_len=1024)
    assert base.total_bytes < torch.total_bytes  # as measured: nybble holds far less


def test_searches_work_for_the_nybble_trainer() -> None:
    est = estimate_memory("qwen3-0.6b", seq_len=2048, framework="nybble", gpu="8GB")
    n = est.max_seq_len(multiple_of=256)
    assert n >= 2048
    assert est._at(seq_len=n).fits() and not est._at(seq_len=n + 256).fits()


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        (dict(model="mixtral-8x7b"), "mixtures of experts"),
        (dict(quant="fp4"), "quant 'fp4'"),
        (dict(optimizer="adamw8bit"), "optimizer 'adamw8bit'"),
        (dict(compute_dtype="float16"), "compute_dtype 'float16'"),
        (dict(lora_dtype="bfloat16"), "lora_dtype"),
        (dict(loop="benchmark"), "loop 'benchmark'"),
        (dict(blocksize=128), "blocksize 128"),
    ],
)
def test_settings_the_trainer_lacks_are_refused_by_name(
    changes: dict[str, Any], needle: str
) -> None:
    args: dict[str, Any] = dict(model="qwen3-0.6b", seq_len=256, framework="nybble")
    args.update(changes)
    model = args.pop("model")
    with pytest.raises(ValueError, match="framework 'nybble' does not model") as info:
        estimate_memory(model, **args)
    assert needle in str(info.value)


def test_the_command_line_takes_the_framework(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "qwen3-0.6b", "--framework", "nybble", "--json", "-s", "512"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["framework"] == "nybble" and d["total_bytes"] == sum(d["breakdown"].values())


def test_the_margin_covers_every_measured_run() -> None:
    for results in ("dev.jsonl", "holdout.jsonl"):
        for run in measured(results):
            est = estimate_of(run["config"])
            assert est.total_bytes + est.margin_bytes >= run["total"], run["name"]
            assert "nybble's trainer" in est.context_source


# --- sizes beyond what the replay walks: refused at once, with the bound ------------------


@pytest.fixture
def no_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any replay fails the test: a refusal must come before the first event."""

    def setup(self: nt.NybbleTimeline) -> None:
        raise AssertionError("the replay started")

    monkeypatch.setattr(nt.NybbleTimeline, "setup", setup)


@pytest.mark.usefixtures("no_replay")
@pytest.mark.parametrize(
    ("model", "changes"),
    [
        ("tiny", dict(seq_len=10**6)),  # issue 39: ran for minutes, GBs of memory
        ("tiny", dict(seq_len=2**24)),
        ("tiny", dict(batch=2**20, seq_len=8192)),
        ("qwen3-0.6b", dict(seq_len=65536)),  # many layers
        (dict(MODEL_PRESETS["tiny"], num_hidden_layers=256), dict(seq_len=32768)),
        (dict(MODEL_PRESETS["tiny"], vocab_size=2**24), dict(batch=64, seq_len=65536)),
    ],
)
def test_sizes_beyond_the_replay_are_refused_at_once_with_the_bound(
    model: Any, changes: dict[str, int]
) -> None:
    with pytest.raises(nt.ReplayLimitError) as info:
        estimate_memory(model, framework="nybble", **changes)  # type: ignore[arg-type]
    e = info.value
    assert f"{nt.MAX_CHUNKS_PER_STEP:,}" in str(e) and "seq_len up to" in str(e)
    # the bound it states is the largest size the replay takes
    s = TrainingSetup.create(model, **changes)  # type: ignore[arg-type]
    assert e.max_seq_len >= 1
    assert nt.chunks_per_step(s.with_(seq_len=e.max_seq_len)) <= nt.MAX_CHUNKS_PER_STEP
    assert nt.chunks_per_step(s.with_(seq_len=e.max_seq_len + 1)) > nt.MAX_CHUNKS_PER_STEP


@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize(("batch", "seq_len"), [(1, 64), (3, 1000), (1, 5000), (2, 3000)])
def test_the_chunk_count_is_what_the_timeline_walks(
    monkeypatch: pytest.MonkeyPatch, checkpointing: bool, batch: int, seq_len: int
) -> None:
    model = dict(MODEL_PRESETS["tiny"], vocab_size=50_000)
    s = TrainingSetup.create(model, batch=batch, seq_len=seq_len, grad_checkpointing=checkpointing)
    walked = []
    chunks = nt.NybbleTimeline._chunks

    def counted(self: nt.NybbleTimeline, group: int) -> Any:
        for c in chunks(self, group):
            walked.append(c)
            yield c

    monkeypatch.setattr(nt.NybbleTimeline, "_chunks", counted)
    timeline = nt.NybbleTimeline(s)
    timeline.setup()
    timeline.step()
    logits = [
        size
        for op, key, size in timeline.tape.events
        if op == "alloc" and timeline.tape.tags[key] == "logits_loss" and size % 50_000 == 0
    ]
    # each chunk of the loss makes its logits and their float32 and gradient copies
    assert nt.chunks_per_step(s) == len(walked) + len(logits) // 3


def test_a_search_stops_at_the_replays_bound_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nt, "MAX_CHUNKS_PER_STEP", 200)
    est = estimate_memory("tiny", framework="nybble", seq_len=512, gpu="80GB")
    n = est.max_seq_len(multiple_of=64)
    s = est.setup
    assert (
        nt.chunks_per_step(s.with_(seq_len=n)) <= 200 < nt.chunks_per_step(s.with_(seq_len=n + 64))
    )
    assert any("stopped at" in note and str(n) in note for note in est.notes)
    with pytest.raises(nt.ReplayLimitError):
        est.sweep_seq_len([n + 64])
