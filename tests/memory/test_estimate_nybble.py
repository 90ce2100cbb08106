"""The estimator's `framework="nybble"` (nybble's own GPU trainer, its code run on the recording
backend): the CuPy pool simulation's rules, the pool against the allocation traces measured
on an H100, the recording against those traces event by event, the estimates against the
measured runs (development and held-out sets, tests/fixtures/memory/nybble/), the settings it
refuses, and what any estimate must satisfy.

The runs were measured on the trainer of commit b16eb74. Two changes since move its memory:
its rotary tables are made before the embedding (49a0b3a; they were made at the first layer's
forward), and bfloat16 attention may run whole in flash kernels (train/_cuda.py). The
recording follows the trainer, so the comparisons with the measurements run it on the trainer
as it was measured (`as_measured`): the two changes undone on the built model."""

from __future__ import annotations

import gzip
import json
import sys
from typing import Any

import pytest

from nybble.cli import main
from nybble.memory import MODEL_PRESETS, TrainingSetup, estimate_memory, get_framework
from nybble.memory import trainer_run as tr
from nybble.memory.cupy_pool import CupyPool, round_size
from tests import FIXTURES, ROOT

RESULTS = FIXTURES / "memory" / "nybble"
BENCH = ROOT / "benchmarks" / "memory"
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


def setup_of(config: dict[str, Any]) -> TrainingSetup:
    sys.path.insert(0, str(BENCH))
    try:
        from measure_nybble import settings
    finally:
        sys.path.pop(0)
    args = settings(config)
    return TrainingSetup.create(args.pop("model"), **args)


class _FirstForwardRope:
    """Positions whose rotary tables are made when a layer first reads them (the measured
    trainer made them at its first layer's forward)."""

    starts = None

    def __init__(self, rope: Any, length: int) -> None:
        self.rope, self.length = rope, length

    @property
    def cos(self) -> Any:
        return self.rope(self.length)[0]

    @property
    def sin(self) -> Any:
        return self.rope(self.length)[1]


@pytest.fixture
def as_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recorded runs of the trainer as the fixtures measured it (see the module docstring)."""
    setup = tr.TrainerRun.setup

    def measured(self: tr.TrainerRun) -> None:
        setup(self)
        model = self.trainer.model
        if hasattr(model.softmax, "flash"):
            model.softmax.flash = False
        rope = model.rope
        model.positions = lambda batch, length, starts: _FirstForwardRope(rope, length)

    monkeypatch.setattr(tr.TrainerRun, "setup", measured)


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


# --- the recording against the measured traces -----------------------------------------


def _recorded(config: dict[str, Any], steps: int = 3) -> list[tuple[str, int]]:
    """(op, bytes as the pool hands them out) of setup and `steps` steps, steps marked."""
    run = tr.TrainerRun(setup_of(config), repeat=False)
    run.setup()
    for _ in range(steps):
        run.step()
    sizes: dict[int, int] = {}
    out: list[tuple[str, int]] = [("step", 0)]
    for op, key, n in run.tape.events:
        if op == "alloc":
            sizes[key] = n
            out.append(("a", round_size(n)))
        elif op == "free":
            out.append(("f", round_size(sizes[key])))
        elif op == "step":
            out.append(("step", key))
    return out


@pytest.mark.usefixtures("as_measured")
def test_the_recording_is_the_measured_trainers_allocations() -> None:
    """The trainer's code on the recording backend makes the allocations and frees the GPU
    run made, event by event: every event of the 4 traces (setup and three steps, 1,781 to
    27,713 events), each of the size CuPy's pool handed out."""
    runs = {r["name"]: r for r in measured("dev.jsonl")}
    for path in sorted((RESULTS / "traces").glob("*.json.gz")):
        run = runs[path.name.removesuffix(".json.gz")]
        trace: list[tuple[str, int]] = []
        at = -1
        for op, _ptr, size, step, _site in json.loads(gzip.decompress(path.read_bytes())):
            if step != at:
                trace.append(("step", step))
                at = step
            trace.append((op, size))
        assert _recorded(run["config"]) == trace, run["name"]


def test_steps_after_the_second_repeat_it() -> None:
    """From the third step on, a run repeats the second's allocations with fresh keys (each
    step frees what the one before kept): the same events as running the trainer again."""

    def steps(s: TrainingSetup, repeat: bool) -> list[list[tuple[Any, ...]]]:
        run = tr.TrainerRun(s, repeat=repeat)
        run.setup()
        where = {k: ("setup", i) for i, k in enumerate(run._alive)}
        out = []
        for number in range(4):
            start = len(run.tape.events)
            run.step()
            step, made = [], 0
            for op, key, n in run.tape.events[start:]:
                if op == "alloc":
                    where[key] = (number, made)
                    made += 1
                    step.append(("a", n, run.tape.tags[key]))
                elif op == "free":
                    step.append(("f", *where[key]))
                else:
                    step.append((op, key))
            out.append(step)
        return out

    for model, changes in [
        ("tiny", dict(seq_len=128)),
        ("qwen3-0.6b", dict(seq_len=512, grad_checkpointing=False, lora_dropout=0.1)),
        ("tiny", dict(quant="bfloat16", seq_len=300, batch=3, compute_dtype="float32")),
        ("qwen3-0.6b", dict(targets="q_proj,v_proj", double_quant=False)),
    ]:
        s = TrainingSetup.create(model, **changes)  # type: ignore[arg-type]
        assert steps(s, repeat=True) == steps(s, repeat=False), (model, changes)


# --- the estimates against the measured runs --------------------------------------------


@pytest.mark.usefixtures("as_measured")
@pytest.mark.parametrize("results", ["dev.jsonl", "holdout.jsonl"])
def test_estimates_match_the_measured_runs(results: str) -> None:
    """Allocated peak to the byte, reserved peak to the byte (but the 512 bytes the recorder
    starts after) and the total (with NVML's outside part) within 2% on every run; the
    issue's bar is 5%. The held-out runs were measured after the model was written."""
    runs = measured(results)
    assert len(runs) >= 4 and all("error" not in r for r in runs)
    for run in runs:
        est = estimate_of(run["config"])
        assert est.framework == "nybble"
        assert est.allocated_peak_bytes == run["peak_allocated"], run["name"]
        assert abs(est.reserved_peak_bytes - run["peak_reserved"]) <= 512, run["name"]
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


@pytest.mark.usefixtures("as_measured")
def test_the_margin_covers_every_measured_run() -> None:
    for results in ("dev.jsonl", "holdout.jsonl"):
        for run in measured(results):
            est = estimate_of(run["config"])
            assert est.total_bytes + est.margin_bytes >= run["total"], run["name"]
            assert "nybble's trainer" in est.context_source


# --- sizes beyond what a recorded run walks: refused at once, with the bound --------------


@pytest.fixture
def no_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any recording fails the test: a refusal must come before the first event."""

    def setup(self: tr.TrainerRun) -> None:
        raise AssertionError("the recording started")

    monkeypatch.setattr(tr.TrainerRun, "setup", setup)


@pytest.mark.usefixtures("no_replay")
@pytest.mark.parametrize(
    ("model", "changes"),
    [
        ("tiny", dict(seq_len=10**6)),  # issue 39: ran for minutes, GBs of memory
        ("tiny", dict(seq_len=2**24)),
        ("tiny", dict(batch=2**20, seq_len=8192)),
        ("qwen3-0.6b", dict(seq_len=65536, compute_dtype="float32")),  # many layers
        ("qwen3-0.6b", dict(seq_len=2**22)),  # the loss's chunks, and the tokens
        (dict(MODEL_PRESETS["tiny"], num_hidden_layers=256), dict(seq_len=32768)),
        (dict(MODEL_PRESETS["tiny"], vocab_size=2**24), dict(batch=64, seq_len=65536)),
    ],
)
def test_sizes_beyond_the_recording_are_refused_at_once_with_the_bound(
    model: Any, changes: dict[str, int]
) -> None:
    with pytest.raises(tr.ReplayLimitError) as info:
        estimate_memory(model, framework="nybble", **changes)  # type: ignore[arg-type]
    e = info.value
    assert f"{tr.MAX_CHUNKS_PER_STEP:,}" in str(e) and "seq_len up to" in str(e)
    # the bound it states is the largest size a recording takes
    s = TrainingSetup.create(model, **changes)  # type: ignore[arg-type]
    assert e.max_seq_len >= 1
    assert tr.recordable(s.with_(seq_len=e.max_seq_len))
    assert not tr.recordable(s.with_(seq_len=e.max_seq_len + 1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize(("batch", "seq_len"), [(1, 64), (3, 1000), (1, 5000), (2, 3000)])
def test_the_chunk_count_is_what_a_recorded_step_walks(
    monkeypatch: pytest.MonkeyPatch, dtype: str, checkpointing: bool, batch: int, seq_len: int
) -> None:
    """`chunks_per_step` counts the chunks of the trainer's attention (none where its
    kernels take it whole) and of its loss that a recorded step walks."""
    from nybble.train import functional as F

    walked: list[Any] = []

    def counting(name: str) -> None:
        real = getattr(F, name)

        def counted(*args: Any) -> Any:
            chunks = real(*args)
            walked.extend(chunks)
            return chunks

        monkeypatch.setattr(F, name, counted)

    model = dict(MODEL_PRESETS["tiny"], vocab_size=50_000, head_dim=64)
    s = TrainingSetup.create(
        model,
        batch=batch,
        seq_len=seq_len,
        grad_checkpointing=checkpointing,
        compute_dtype=dtype,
    )
    run = tr.TrainerRun(s)
    run.setup()
    counting("attention_chunks")
    counting("head_chunks")
    run.step()
    assert tr.chunks_per_step(s) == len(walked)


def test_a_search_stops_at_the_recordings_bound_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tr, "MAX_CHUNKS_PER_STEP", 200)
    est = estimate_memory("tiny", framework="nybble", seq_len=512, gpu="80GB")
    n = est.max_seq_len(multiple_of=64)
    s = est.setup
    assert tr.recordable(s.with_(seq_len=n)) and not tr.recordable(s.with_(seq_len=n + 64))
    assert any("stopped at" in note and str(n) in note for note in est.notes)
    with pytest.raises(tr.ReplayLimitError):
        est.sweep_seq_len([n + 64])


def test_the_lower_bound_is_below_the_step_and_costs_no_step() -> None:
    model = get_framework("nybble")
    for name, changes in [
        ("qwen3-0.6b", dict(seq_len=1024)),
        ("qwen3-0.6b", dict(seq_len=700, batch=3, grad_checkpointing=False)),
        ("tiny", dict(seq_len=4096, quant="bfloat16", compute_dtype="float32")),
    ]:
        s = TrainingSetup.create(name, **changes)  # type: ignore[arg-type]
        assert 0 < model.lower_bound(s) <= model.footprint(s).peak.total


def test_the_recording_allocates_nothing_it_describes() -> None:
    """A 70B-shaped model at 32k tokens: the recorded step holds tens of GiB on the GPU; the
    process's own memory hardly moves, and the estimate takes about a second."""
    import resource
    import time

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.process_time()
    big = dict(
        MODEL_PRESETS["llama-3.1-8b"],
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
    )
    est = estimate_memory(big, framework="nybble", seq_len=32768)
    seconds = time.process_time() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB
    assert est.allocated_peak_bytes > 40 << 30
    assert grown < 200 << 10, f"the process grew by {grown >> 10} MiB"
    assert seconds < 5, f"{seconds:.1f} s of CPU"
