"""The allocator simulation against PyTorch's own: allocation traces of real transformers + PEFT
+ bitsandbytes QLoRA runs on an H100 (benchmarks/memory/measure_peft_bnb.py --trace: model
load, kbit preparation, PEFT, two training steps) replayed through the simulation must end
with the segments the real allocator had cudaMalloc'd, and peak where it peaked."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from nybble.memory.allocator import replay
from tests import FIXTURES

TRACES = sorted((FIXTURES / "memory" / "traces").glob("*.json.gz"))


def trace_events(doc: dict[str, Any]) -> tuple[list[tuple[str, int, int]], int, int]:
    """(the trace as `replay` events, the real reserved bytes at its end, the real peak of
    reserved bytes from step 2's start). Frees take effect when the trace completes them; a run
    of segment frees is an empty_cache() (prepare_model_for_kbit_training calls it); segments
    get their real addresses, which break ties between equal free blocks as they did."""
    actions = {name: i for i, name in enumerate(doc["actions"])}
    mark, points = doc["marks"][0], doc["marks"][1:]
    events: list[tuple[str, int, int]] = []
    reserved = peak = 0
    measuring = False
    last = None
    for action, addr, size, _tag in doc["events"]:
        if action == actions["alloc"]:
            if mark <= size < mark + len(points) and points[size - mark] == "step2":
                events.append(("reset_peak", 0, 0))
                measuring, peak = True, reserved
            events.append(("alloc", addr, size))
        elif action == actions["free_completed"]:
            events.append(("free", addr, 0))
        elif action == actions["segment_alloc"]:
            events.append(("place_segment", addr, 0))
            reserved += size
            peak = max(peak, reserved) if measuring else peak
        elif action == actions["segment_free"]:
            if last != action:
                events.append(("empty_cache", 0, 0))
            reserved -= size
        last = action
    return events, reserved, peak


@pytest.mark.parametrize("path", TRACES, ids=[p.name.split(".")[0] for p in TRACES])
def test_replayed_trace_reserves_what_torch_reserved(path: Path) -> None:
    doc = json.load(gzip.open(path, "rt"))
    events, reserved, peak = trace_events(doc)
    sim = replay(events)
    assert sim.reserved == reserved
    assert sim.peak_reserved == peak


def test_there_are_traces() -> None:
    assert len(TRACES) >= 8


def _timeline_replay(doc: dict[str, Any]) -> Any:
    from nybble.memory import MODEL_PRESETS
    from nybble.memory.setup import TrainingSetup
    from nybble.memory.timeline import peft_bnb_events

    c = doc["config"]
    preset = dict(MODEL_PRESETS[c["arch"]], num_hidden_layers=c["layers"])
    setup = TrainingSetup.create(
        preset, batch=c["batch"], seq_len=c["seq"], grad_checkpointing=c["gc"], loop="benchmark"
    )
    return replay(peft_bnb_events(setup, loop="benchmark", steps=2))


def test_estimators_timeline_reaches_the_traced_peaks() -> None:
    """The estimator writes the run's allocations from the architecture alone
    (`timeline.peft_bnb_events`, the traced script's loop); replayed, with segments placed as
    the driver places them,
    they must peak where the real run did: allocated and reserved bytes within 0.5% in every
    trace (what is left is the small pool's 2 MiB segments)."""
    for path in TRACES:
        doc = json.load(gzip.open(path, "rt"))
        real = replay(trace_events(doc)[0])
        sim = _timeline_replay(doc)
        alloc_err = sim.peak_allocated / real.peak_allocated - 1
        assert abs(alloc_err) < 0.005, (path.name, alloc_err)
        reserved_err = sim.peak_reserved / real.peak_reserved - 1
        assert abs(reserved_err) < 0.005, (path.name, reserved_err)
