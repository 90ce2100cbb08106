"""The memory-budget estimator (docs/estimator.md): architecture facts, codec sizes, the search, the
framework registry, bad input, and the committed H100 measurements."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import nybble
from nybble.errors import FormatError
from nybble.memory import (
    BREAKDOWN_KEYS,
    DEFAULT_OUTSIDE_ALLOCATOR,
    MODEL_PRESETS,
    Architecture,
    Footprint,
    FrameworkModel,
    Phase,
    TrainingSetup,
    codec_nbytes,
    estimate_memory,
    parse_size,
    register_framework,
    resolve_model,
    stored_weight,
)
from nybble.memory.estimate import _largest_within
from nybble.memory.frameworks import FRAMEWORKS, blk
from nybble.memory.presets import GiB, MiB
from tests import FIXTURES

#: Measured runs (benchmarks/memory/measure_peft_bnb.py), kept as the validation fixtures.
MEASURED = FIXTURES / "memory"


# --- fixture facts (docs/contracts.md) ------------------------------------------------------------


def test_qwen3_4b_parameter_counts() -> None:
    a = resolve_model("qwen3-4b")
    assert a.num_parameters == 4_022_468_096
    assert a.lora_parameters(16, nybble.memory.PROJECTIONS) == 33_030_144
    assert a.head_dim == 128 and a.q_dim == 4096 and a.hidden_size == 2560  # explicit head_dim
    assert a.tie_word_embeddings and a.lm_head_params == 0


def test_llama_31_8b_parameter_counts() -> None:
    a = resolve_model("llama-3.1-8b")
    assert a.num_parameters == 8_030_261_248
    assert a.lora_parameters(16, nybble.memory.PROJECTIONS) == 41_943_040
    assert not a.tie_word_embeddings and a.lm_head_params == a.embedding_params


def test_estimate_reports_the_same_counts() -> None:
    d = estimate_memory("qwen3-4b").to_dict()
    assert d["parameters"] == 4_022_468_096
    assert d["lora_parameters"] == 33_030_144


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_every_preset_estimates(name: str) -> None:
    est = estimate_memory(name, seq_len=512)
    assert est.total_bytes > 0
    assert set(est.breakdown) == set(BREAKDOWN_KEYS)


def test_gqa_and_tied_embeddings_change_the_figures() -> None:
    base = dict(MODEL_PRESETS["llama-3.1-8b"], num_hidden_layers=2)
    mha = dict(base, num_key_value_heads=32)
    tied = dict(base, tie_word_embeddings=True)
    a, m, t = (resolve_model(c) for c in (base, mha, tied))
    assert a.is_gqa and not m.is_gqa
    assert m.num_parameters - a.num_parameters == 2 * 2 * 4096 * (4096 - 1024)
    assert a.num_parameters - t.num_parameters == 128256 * 4096
    e_a, e_t = estimate_memory(base), estimate_memory(tied)
    assert e_a.breakdown["unquantized_weights"] - e_t.breakdown["unquantized_weights"] == blk(
        4 * 128256 * 4096
    )


# --- the per-layer NF4 figures agree with what the codec allocates -------------------------

QWEN3_4B_LAYER = resolve_model("qwen3-4b").linear_shapes()


@pytest.mark.parametrize("blocksize", [64, 256])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("name", ["k_proj", "o_proj", "down_proj"])
def test_nf4_layer_bytes_equal_the_codec(name: str, blocksize: int, double_quant: bool) -> None:
    shape = QWEN3_4B_LAYER[name]
    q = nybble.quantize(np.zeros(shape, np.float32), blocksize=blocksize, double_quant=double_quant)
    n = math.prod(shape)
    assert codec_nbytes(n, "nf4", blocksize, double_quant) == q.nbytes
    w = stored_weight(n, "nf4", blocksize, double_quant)
    assert w.codes == q.codes.nbytes


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 64 * 256, 64 * 256 + 1, 64 * 300])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("codebook", ["nf4", "fp4", "int8"])
def test_odd_sizes_equal_the_codec(n: int, double_quant: bool, codebook: str) -> None:
    q = nybble.quantize(
        np.zeros(n, np.float32), blocksize=64, double_quant=double_quant, codebook=codebook
    )
    assert codec_nbytes(n, codebook, 64, double_quant) == q.nbytes


def test_qwen3_4b_layer_is_under_60_mb_as_nf4() -> None:
    total = sum(codec_nbytes(o * i, "nf4", 64) for o, i in QWEN3_4B_LAYER.values())
    assert total < 60e6


def test_replayed_weight_storage_is_the_codec_layout() -> None:
    """The weights in the breakdown are the replayed blocks of bitsandbytes' storage: the
    codec's codes, and its constants less the 4-byte nested offset (a Python float in bnb),
    each block rounded to 512 bytes by the allocator (a large block may keep an unsplit
    remainder of at most 1 MiB)."""
    est = estimate_memory("qwen3-4b", seq_len=256)
    layers = est.setup.arch.num_layers
    weights = [stored_weight(o * i, "nf4", 64, True) for o, i in QWEN3_4B_LAYER.values()]
    codes = layers * sum(w.codes for w in weights)
    consts = layers * sum(blk(w.nblocks) + blk(4 * w.nested_blocks) for w in weights)
    assert codes <= est.breakdown["quantized_weights"] <= codes + layers * 7 * MiB
    assert consts <= est.breakdown["quant_constants"] <= consts + layers * 7 * MiB


def test_formats_order_by_size() -> None:
    sizes = {
        q: estimate_memory("llama-3.1-8b", quant=q, seq_len=256).breakdown
        for q in ("nf4", "int8", "bf16")
    }

    def base(b: dict[str, int]) -> int:
        return b["quantized_weights"] + b["quant_constants"]

    assert base(sizes["nf4"]) < base(sizes["int8"])
    assert sizes["bf16"]["quantized_weights"] == 0
    assert sizes["bf16"]["unquantized_weights"] > base(sizes["int8"])


# --- the estimate object ----------------------------------------------------------------


def test_total_is_the_sum_of_the_breakdown() -> None:
    est = estimate_memory("llama-3.2-1b", batch=2, seq_len=1024)
    assert sum(est.breakdown.values()) == est.total_bytes
    assert tuple(est.breakdown) == BREAKDOWN_KEYS
    assert est.allocated_peak_bytes <= est.reserved_peak_bytes
    assert est.reserved_peak_bytes + est.context_bytes == est.total_bytes
    assert est.breakdown["outside_allocator"] == est.context_bytes
    assert est.breakdown["allocator_cache"] == est.reserved_peak_bytes - est.allocated_peak_bytes
    assert est.peak_phase in est.phases
    assert max(est.phases.values()) == est.allocated_peak_bytes


def test_memory_grows_with_batch_and_seq_len() -> None:
    totals = [estimate_memory("qwen3-0.6b", batch=b).total_bytes for b in (1, 2, 4)]
    assert totals == sorted(totals) and totals[0] < totals[-1]
    totals = [estimate_memory("qwen3-0.6b", seq_len=n).total_bytes for n in (256, 1024, 4096)]
    assert totals == sorted(totals) and totals[0] < totals[-1]


def test_checkpointing_saves_memory_at_long_sequences() -> None:
    on = estimate_memory("llama-3.1-8b", seq_len=4096)
    off = estimate_memory("llama-3.1-8b", seq_len=4096, grad_checkpointing=False)
    assert on.total_bytes < off.total_bytes
    assert on.breakdown["activations"] < off.breakdown["activations"]


def test_math_attention_is_quadratic_for_gqa_and_not_for_mha() -> None:
    def act(preset: dict[str, object], n: int) -> int:
        return estimate_memory(preset, seq_len=n, grad_checkpointing=False).allocated_peak_bytes

    gqa = dict(MODEL_PRESETS["mistral-7b"], num_hidden_layers=2, vocab_size=1024)
    mha = dict(gqa, num_key_value_heads=32)
    # doubling the sequence: a quadratic term more than doubles the growth
    g = act(gqa, 4096) - act(gqa, 2048), act(gqa, 2048) - act(gqa, 1024)
    m = act(mha, 4096) - act(mha, 2048), act(mha, 2048) - act(mha, 1024)
    assert g[0] > 3 * g[1]
    assert m[0] < 2.5 * m[1]
    assert any("math backend" in n for n in estimate_memory(gqa).notes)


def test_fits_and_search() -> None:
    est = estimate_memory("qwen3-4b", seq_len=2048)
    assert est.fits("80GiB") and not est.fits("1GiB")
    assert est.fits(est.required_bytes) and not est.fits(est.required_bytes - 1)
    gpu = 24 * GiB
    b = est.max_batch(gpu)
    assert b >= 1
    assert estimate_memory("qwen3-4b", batch=b).fits(gpu)
    assert not estimate_memory("qwen3-4b", batch=b + 1).fits(gpu)
    n = est.max_seq_len(gpu)
    assert estimate_memory("qwen3-4b", seq_len=n).fits(gpu)
    assert not estimate_memory("qwen3-4b", seq_len=n + 1).fits(gpu)
    n64 = est.max_seq_len(gpu, multiple_of=64)
    assert n64 % 64 == 0 and n - 64 < n64 <= n
    assert est.max_batch("1GiB") == 0 and est.max_seq_len("1GiB") == 0
    assert est.headroom(gpu) == gpu - est.required_bytes


@given(
    steps=st.lists(st.integers(0, 3000), min_size=1, max_size=60),
    limit=st.integers(0, 60_000),
    top=st.integers(0, 80),
)
def test_the_bracketed_search_finds_the_last_fit(steps: list[int], limit: int, top: int) -> None:
    """Any non-decreasing total (flat stretches and jumps, as the allocator's rounding
    makes): the same answer as walking n up one at a time, in few evaluations."""
    totals = np.cumsum([0, *steps, *[10**9] * 100])
    calls: list[int] = []

    def total(n: int) -> int:
        calls.append(n)
        return int(totals[n])

    want = max((n for n in range(1, top + 1) if totals[n] <= limit), default=0)
    assert _largest_within(total, limit, top) == want
    assert len(calls) <= 2 + 2 * max(top, 1).bit_length()


def test_other_knobs_move_the_right_parts() -> None:
    base = estimate_memory("qwen3-4b")
    r64 = estimate_memory("qwen3-4b", lora_r=64)
    assert r64.breakdown["lora_params"] > 3 * base.breakdown["lora_params"]
    sgd = estimate_memory("qwen3-4b", optimizer="sgd")
    adam8 = estimate_memory("qwen3-4b", optimizer="adamw8bit")
    assert sgd.breakdown["optimizer_states"] == 0
    assert 0 < adam8.breakdown["optimizer_states"] < base.breakdown["optimizer_states"] / 3
    qv = estimate_memory("qwen3-4b", targets=["q_proj", "v_proj"])
    assert qv.to_dict()["lora_parameters"] == 36 * 16 * (2560 + 4096 + 2560 + 1024)
    assert qv.total_bytes < base.total_bytes
    single = estimate_memory("qwen3-4b", double_quant=False)
    assert single.breakdown["quant_constants"] > 3 * base.breakdown["quant_constants"]


def test_json_dict_is_serialisable() -> None:
    d = estimate_memory("tiny", seq_len=128).to_dict()
    again = json.loads(json.dumps(d))
    assert again["total_bytes"] == d["total_bytes"]
    assert again["settings"]["targets"] == list(nybble.memory.PROJECTIONS)


# --- models from config dicts and files -------------------------------------------------


def test_config_json_path_and_dict(tmp_path: Path) -> None:
    cfg = dict(MODEL_PRESETS["qwen3-4b"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    from_file = estimate_memory(str(path))
    from_dir = estimate_memory(tmp_path)
    from_dict = estimate_memory(cfg)
    preset = estimate_memory("qwen3-4b")
    assert from_file.total_bytes == from_dir.total_bytes == from_dict.total_bytes
    assert from_dict.total_bytes == preset.total_bytes


def test_head_dim_defaults_to_hidden_over_heads() -> None:
    a = Architecture.from_config(
        dict(
            model_type="llama",
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=2,
            num_attention_heads=8,
            vocab_size=100,
        )
    )
    assert a.head_dim == 64 and a.num_kv_heads == 8


@pytest.mark.parametrize("missing", ["hidden_size", "num_hidden_layers", "vocab_size"])
def test_config_missing_a_field_names_it(tmp_path: Path, missing: str) -> None:
    cfg = dict(MODEL_PRESETS["llama-3.2-1b"])
    del cfg[missing]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(FormatError) as e:
        estimate_memory(str(path))
    assert e.value.field == missing and e.value.source == str(path)


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ValueError) as e:
        estimate_memory("gpt-17")
    for name in ("qwen3-4b", "llama-3.1-8b", "mistral-7b", "tiny"):
        assert name in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(lora_r=0), "lora_r"),
        (dict(lora_r=-3), "lora_r"),
        (dict(batch=-1), "batch"),
        (dict(batch=0), "batch"),
        (dict(seq_len=0), "seq_len"),
        (dict(quant="nf3"), "quant"),
        (dict(blocksize=48), "blocksize"),
        (dict(targets=["q_proj", "wq"]), "wq"),
        (dict(targets=[]), "targets"),
        (dict(optimizer="lion"), "optimizer"),
        (dict(lora_dtype="int4"), "lora_dtype"),
        (dict(lora_dropout=1.5), "lora_dropout"),
        (dict(framework="deepspeed"), "framework"),
        (dict(lora_r=5000), "exceeds"),
    ],
)
def test_bad_values_raise_value_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        estimate_memory("qwen3-4b", **kwargs)  # type: ignore[arg-type]


def test_search_rejects_bad_gpu_sizes() -> None:
    est = estimate_memory("tiny")
    with pytest.raises(ValueError):
        est.fits("lots")
    with pytest.raises(ValueError):
        est.max_seq_len("24GiB", multiple_of=0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * GiB),
        ("24 gib", 24 * GiB),
        ("16GB", 16 * GiB),  # GPU labels' GB is binary: a "16 GB" card holds 16 GiB
        ("80g", 80 * GiB),
        ("512MiB", 512 * MiB),
        ("rtx4090", 24564 * MiB),
        ("A100-40G", 40 * GiB),
        ("1234", 1234),
        (2048, 2048),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-4GiB", "0", "24 parsecs", "rtx9999"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


# --- a second runtime is one more framework model ---------------------------------------


def test_a_new_framework_is_one_class() -> None:
    class Flat(FrameworkModel):
        name = "flat-test"
        description = "everything in one phase"

        def footprint(self, setup: TrainingSetup) -> Footprint:
            parts = {"activations": setup.tokens * 1000}
            return Footprint([Phase("only", parts)], allocator_cache=10, context=100)

    register_framework(Flat())
    try:
        est = estimate_memory("tiny", batch=3, seq_len=10, framework="flat-test")
        assert est.total_bytes == 30_000 + 10 + 100
        assert est.breakdown["allocator_cache"] == 10
        assert est.breakdown["outside_allocator"] == 100
        assert est.max_batch(3 * 10_000 + 110) == 3
    finally:
        del FRAMEWORKS["flat-test"]


# --- against the peaks measured on an H100 (benchmarks/memory/) ---------------------------
# The committed results were measured with the benchmark script's loop (`loop="benchmark"`)
# before the protocol counted the memory outside the allocator after a step: they check the
# replayed reserved and allocated peaks, which the new definition keeps.


def _measured(name: str = "measured.jsonl") -> list[dict[str, Any]]:
    path = MEASURED / "old-protocol" / name
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if "step2" in r]


@functools.cache
def _old_protocol(name: str) -> list[tuple[dict[str, Any], nybble.memory.MemoryEstimate]]:
    out = []
    for rec in _measured(name):
        preset = dict(MODEL_PRESETS[str(rec["arch"])], num_hidden_layers=rec["layers"])
        est = estimate_memory(
            preset,
            lora_r=int(rec.get("r", 16)),
            lora_dropout=float(rec.get("dropout", 0.0)),
            optimizer=str(rec.get("optim", "adamw")),
            batch=int(rec["batch"]),
            seq_len=int(rec["seq"]),
            grad_checkpointing=bool(rec["gc"]),
            loop="benchmark",
        )
        out.append((rec, est))
    return out


def test_measurements_cover_what_the_issue_asks() -> None:
    rows = _measured()
    assert len(rows) >= 40
    archs = {r["arch"] for r in rows}
    assert {"qwen3-0.6b", "qwen3-4b", "llama-3.2-1b", "llama-3.1-8b", "mistral-7b"} <= archs
    for arch in ("qwen3-4b", "llama-3.1-8b", "mistral-7b"):
        mine = [r for r in rows if r["arch"] == arch]
        assert {r["seq"] for r in mine} >= {512, 2048}
        assert {r["batch"] for r in mine} >= {1, 2}
        assert {r["gc"] for r in mine} == {True, False}


@pytest.mark.parametrize("name", ["measured.jsonl", "holdout.jsonl"])
def test_replayed_peaks_match_the_benchmark_measurements(name: str) -> None:
    """51 measured and 14 held-out configurations: the reserved peak of the steady step within
    1% (mean under 0.1%), the allocated peak within 2%."""
    reserved_errors = []
    for rec, est in _old_protocol(name):
        measured = rec["step2"]["peak_reserved"]
        reserved_errors.append((est.reserved_peak_bytes - measured) / measured)
        alloc = rec["step2"]["peak_allocated"]
        err = (est.allocated_peak_bytes - alloc) / alloc
        assert abs(err) < 0.02, (rec["arch"], rec["layers"], rec["batch"], rec["seq"], err)
    assert len(reserved_errors) == {"measured.jsonl": 51, "holdout.jsonl": 14}[name]
    assert max(abs(e) for e in reserved_errors) < 0.01, reserved_errors
    assert sum(abs(e) for e in reserved_errors) / len(reserved_errors) < 0.001


def test_the_outside_part_is_the_measured_one() -> None:
    """742 MiB after every step of every dense run of the validation (NVML minus reserved), and
    at the end of the old protocol's benchmark runs; the mixtures of experts 2 MiB more."""
    assert DEFAULT_OUTSIDE_ALLOCATOR == 742 * MiB
    assert estimate_memory("tiny", seq_len=64).context_bytes == DEFAULT_OUTSIDE_ALLOCATOR
    for rec, _ in _old_protocol("measured.jsonl"):
        outside = rec["nvml_process_end"] - rec["step3"]["phases"]["end"]["reserved"]
        assert outside == DEFAULT_OUTSIDE_ALLOCATOR
    for rec in _validation():
        for step in rec["steps"]:
            assert 0 <= step["outside"] - DEFAULT_OUTSIDE_ALLOCATOR <= 2 * MiB, rec["run"]


# --- against the validation run (tests/fixtures/memory/results.jsonl) ---------------------
# measure_peft_bnb.py as docs/estimator.md describes it: one fresh process per configuration,
# the plain loop of docs/estimator.md (the diagnose pair in the benchmark loop too), 4 steps,
# NVML after each;
# the measured total is the steady step's reserved peak plus the memory outside the allocator.


def _validation() -> list[dict[str, Any]]:
    path = MEASURED / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@functools.cache
def _validation_estimates() -> list[tuple[dict[str, Any], nybble.memory.MemoryEstimate]]:
    out = []
    for rec in _validation():
        est = estimate_memory(
            dict(rec["config"], num_hidden_layers=rec["layers"]),
            lora_r=int(rec.get("r", 16)),
            lora_dropout=float(rec.get("dropout", 0.0)),
            optimizer=str(rec.get("optim", "adamw")),
            batch=int(rec["batch"]),
            seq_len=int(rec["seq"]),
            grad_checkpointing=bool(rec["gc"]),
            loop=str(rec["loop"]),
        )
        out.append((rec, est))
    return out


def _error(est: nybble.memory.MemoryEstimate, rec: dict[str, Any]) -> float:
    return float((est.total_bytes - rec["measured_total"]) / rec["measured_total"])


def test_the_validation_run_covers_the_sets() -> None:
    rows = _validation()
    assert all("error" not in r and len(r["steps"]) >= 3 for r in rows)
    sets = {name: sum(r["set"] == name for r in rows) for name in {r["set"] for r in rows}}
    assert sets == {"committed": 50, "holdout": 11, "new": 10, "moe": 4, "diagnose": 4}
    assert {r["loop"] for r in rows if r["set"] == "diagnose"} == {"plain", "benchmark"}


def test_totals_are_within_3_percent_of_the_validation_run() -> None:
    """The measured total (docs/estimator.md) of every configuration, committed, held out,
    new, diagnose and the
    mixtures of experts, within ±3% of the measured one (issue 18's criterion); the reserved
    peak, which the replay gives, within 1% in all but the tiny model at 1024 tokens (one 20
    MiB segment short: docs/estimator.md)."""
    runs = _validation_estimates()
    assert len(runs) == 79
    errors = {rec["run"] + "/" + rec["set"]: _error(est, rec) for rec, est in runs}
    assert max(abs(e) for e in errors.values()) <= 0.03, errors
    dense = [abs(e) for key, e in errors.items() if not key.endswith("/moe")]
    assert sorted(dense)[-2] < 0.001  # the tiny model's is the one beyond 0.1%
    for rec, est in runs:
        off = est.reserved_peak_bytes - rec["measured_reserved"]
        if rec["arch"] != "tiny":
            assert abs(off) <= 0.01 * rec["measured_reserved"], (rec["run"], off)


def test_the_margin_covers_every_validation_run() -> None:
    """Each measured total is at most the estimate plus its margin, and the margin is no more
    than 1% of the reserved peak (at least 20 MiB, in whole 2 MiB)."""
    for rec, est in _validation_estimates():
        assert rec["measured_total"] <= est.total_bytes + est.margin_bytes, rec["run"]
        assert est.margin_bytes <= max(20 * MiB, est.reserved_peak_bytes // 100 + 2 * MiB)


def test_every_step_of_the_validation_run_is_replayed() -> None:
    """The replay's reserved peak of steps 1 to 3 against the measured ones: within 1% (the
    tiny model aside) at every step, so also where step 1 reserves less than step 2."""
    grew = 0
    for rec, est in _validation_estimates():
        measured = [s["peak_reserved"] for s in rec["steps"]]
        replayed = est.step_reserved_bytes[1:]
        grew += measured[1] > measured[0]
        if rec["arch"] == "tiny":
            continue
        for m, r in zip(measured, replayed, strict=False):
            assert abs(r - m) <= 0.01 * m, (rec["run"], measured, replayed)
    assert grew >= 10


def test_trainable_parameters_are_what_peft_made() -> None:
    """PEFT's trainable parameter count of every validation run, the fused experts of Mixtral
    and Qwen3-MoE included (Qwen2-MoE's keep none)."""
    for rec, est in _validation_estimates():
        assert est.to_dict()["lora_parameters"] == rec["trainable_params"], rec["run"]


# --- what the verdicts count beyond the replayed step (issue 39) ---------------------------


def _issue39() -> dict[str, Any]:
    return dict(json.loads((MEASURED / "issue39.jsonl").read_text()))


def _estimate_of(rec: dict[str, Any]) -> nybble.memory.MemoryEstimate:
    return estimate_memory(
        dict(rec["config"], num_hidden_layers=rec["layers"]),
        batch=rec["batch"],
        seq_len=rec["seq"],
        grad_checkpointing=rec["gc"],
        loop=rec["loop"],
    )


def test_the_verdict_covers_the_run_that_grew_by_a_logits_block_from_step_2() -> None:
    """Issue 39: llama-3.2-1b, 1 x 512, NF4 + double quantization, r=16 all-linear,
    non-reentrant checkpointing enabled after get_peft_model, the plain loop: 2738 MiB reserved
    in step 1, 2990 in steps 2 and 3, 751 MiB outside the allocator (3.65 GiB). The replay of
    the modelled recipe reserves 2740 MiB in every step (as that recipe measured); the verdict
    counts the logits block it cannot rule out, and the outside part at its most measured."""
    rec = _issue39()
    steps = [s["peak_reserved"] for s in rec["steps"]]
    assert steps == [2738 * MiB, 2990 * MiB, 2990 * MiB]
    assert rec["measured_total"] == steps[1] + 751 * MiB
    est = _estimate_of(rec)
    assert est.step_reserved_bytes[1:] == [2740 * MiB] * 3
    assert est.total_bytes < rec["measured_total"]  # the replayed step alone: -6.9%
    logits = 4 * rec["batch"] * rec["seq"] * rec["config"]["vocab_size"]
    assert est.details["largest_request"] == logits
    assert est.unruled_block_bytes == steps[1] - steps[0] == 252 * MiB
    assert est.required_bytes >= rec["measured_total"]
    assert not est.fits(rec["measured_total"] - 1)  # where the run ran out of memory
    assert any("step 2" in note for note in est.notes)


def test_the_block_is_counted_unless_the_replay_reserves_it_already() -> None:
    """Over the validation run: where the replay's steady step reserves a block of the largest
    tensor more than step 1 (13 runs measured so), nothing more is counted; elsewhere one such
    block is. Either way what the verdict counts covers the measured total (the tiny model's
    one 20 MiB segment aside, which the margin covers)."""
    counted = 0
    for rec, est in _validation_estimates():
        steps = est.step_reserved_bytes
        block = nybble.memory.allocator.allocation_size(
            nybble.memory.allocator.round_size(est.details["largest_request"])
        )
        grew = steps[-1] - steps[1] >= block
        assert est.unruled_block_bytes == (0 if grew else block), rec["run"]
        counted += not grew
        assert est.required_bytes >= est.total_bytes
        if rec["arch"] != "tiny":
            assert est.required_bytes >= rec["measured_total"], rec["run"]
        assert est.required_bytes + est.margin_bytes >= rec["measured_total"], rec["run"]
    assert 0 < counted < len(_validation())


def test_a_given_outside_part_is_counted_as_given() -> None:
    est = estimate_memory("tiny", seq_len=128, context="700MiB")
    assert est.context_high_bytes == 0
    assert est.required_bytes == est.reserved_peak_bytes + est.unruled_block_bytes + 700 * MiB
    default = estimate_memory("tiny", seq_len=128)
    assert default.required_bytes - default.total_bytes == (
        default.unruled_block_bytes + (751 - 742) * MiB
    )
    own = estimate_memory("tiny", seq_len=128, framework="nybble")  # the trainer's own loop
    assert own.required_bytes == own.total_bytes
