"""The estimate per GPU on several GPUs (docs/estimator.md, "Several GPUs"; issue 43): FSDP2 for
nybble's torch layer, FSDP1 with a storage dtype for bitsandbytes, DDP for both, CPU offload.

The tests check the model's own relations (the parts add up, one GPU with a strategy is the
single-GPU run plus the engine's extras, more GPUs hold less), pieces computed by hand from the
engines' rules (shard sizes, flat-parameter padding, DDP's buckets), never totals the code
computed itself, and the estimate against the peaks measured on H200s at one and two GPUs
(tests/fixtures/memory/fsdp_h200.json, from benchmarks/fsdp_gpu.py)."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from nybble.cli import main
from nybble.memory import MODEL_PRESETS, TrainingSetup, estimate_memory
from nybble.memory.distributed import (
    DDP_BUCKET_CAP,
    DDP_FIRST_BUCKET,
    NCCL_WORKSPACE,
    NCCL_WORKSPACE_MEASURED,
    ddp_buckets,
    fsdp1_layout,
    nccl_workspace,
    nf4_shard,
    timeline_for,
)
from nybble.memory.parts import (
    BREAKDOWN_KEYS,
    COMM_BUFFERS,
    DISTRIBUTED_PARTS,
    GATHERED_PARAMS,
    GRADIENTS,
    LORA_PARAMS,
    OPTIMIZER_STATES,
    QUANT_CONSTANTS,
    QUANTIZED_WEIGHTS,
    UNQUANTIZED_WEIGHTS,
)
from nybble.memory.presets import MiB

NCCL_PART = "nccl_workspace"  # the breakdown's part (parts.NCCL_WORKSPACE)

LLAMA_70B = MODEL_PRESETS["llama-3.1-70b"]
#: The Llama-3.1-70B shape with a few layers (the replay's cost grows with them).
SHORT_70B = dict(LLAMA_70B, num_hidden_layers=2)
H, INTER, V, R = 8192, 28672, 128256, 16
#: (out_features, in_features) of the seven projections of a Llama-3.1-70B layer.
PROJ = [(8192, H), (1024, H), (1024, H), (H, 8192), (INTER, H), (INTER, H), (H, INTER)]


def _live(s: TrainingSetup, framework: str, until_phase: str | None = None) -> dict[str, int]:
    """Bytes requested and not yet freed, by breakdown part, after the setup and two steps
    of `s`'s timeline (or when step 2 reaches `until_phase`): the events, without the
    allocator's rounding."""
    timeline = timeline_for(s, framework)
    events = timeline.events(steps=2)
    tags, phases = timeline.tape.tags, timeline.tape.phases
    sizes: dict[int, int] = {}
    live: Counter[str] = Counter()
    step = 0
    for op, key, size in events:
        if op == "alloc":
            sizes[key] = size
            live[tags[key]] += size
        elif op == "free":
            live[tags[key]] -= sizes.pop(key)
        elif op == "step":
            step = key
        elif op == "phase" and step == 2 and phases[key] == until_phase:
            break
    return {k: v for k, v in live.items() if v}


def _setup(cfg: Any = SHORT_70B, **kw: Any) -> TrainingSetup:
    return TrainingSetup.create(cfg, seq_len=kw.pop("seq_len", 256), **kw)


def _lora_elements(layers: int, r: int = R) -> int:
    """LoRA A [r, in] and B [out, r] of every projection: r * (in + out) each."""
    return layers * sum(r * (o + i) for o, i in PROJ)


# --- the API ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("framework", "kw"),
    [
        ("nybble-torch", dict(gpus=2)),
        ("nybble-torch", dict(gpus=4, offload=True)),
        ("nybble-torch", dict(gpus=2, strategy="ddp")),
        ("peft-bnb", dict(gpus=2)),
        ("peft-bnb", dict(gpus=4, lora_dtype="bfloat16", offload=True)),
        ("peft-bnb", dict(gpus=1, strategy="fsdp")),
        ("peft-bnb", dict(gpus=2, strategy="ddp", grad_checkpointing=False)),
    ],
)
def test_the_per_gpu_total_is_the_sum_of_its_parts(framework: str, kw: dict[str, Any]) -> None:
    est = estimate_memory(SHORT_70B, seq_len=256, framework=framework, **kw)
    assert tuple(est.breakdown) == BREAKDOWN_KEYS
    assert sum(est.breakdown.values()) == est.total_bytes
    assert est.breakdown[NCCL_PART] == est.nccl_bytes == nccl_workspace(est.setup.gpus)
    assert est.required_bytes >= est.total_bytes
    assert est.host_bytes == sum(est.host_breakdown.values())
    assert (est.host_bytes > 0) == est.setup.offload
    d = est.to_dict()
    assert d["settings"]["gpus"] == est.setup.gpus and d["settings"]["strategy"] in ("fsdp", "ddp")
    assert d["host_bytes"] == est.host_bytes and "per GPU" in repr(est)


def test_one_gpu_without_a_strategy_is_todays_estimate() -> None:
    today = estimate_memory("qwen3-0.6b", seq_len=512)
    same = estimate_memory("qwen3-0.6b", seq_len=512, gpus=1, strategy=None, offload=False)
    assert same.to_dict() == today.to_dict()
    assert all(today.breakdown[p] == 0 for p in DISTRIBUTED_PARTS)
    assert today.host_bytes == 0 and not today.setup.distributed


def test_several_gpus_default_to_fsdp() -> None:
    assert TrainingSetup.create("tiny", gpus=2).strategy == "fsdp"
    assert TrainingSetup.create("tiny", offload=True).strategy == "fsdp"
    assert TrainingSetup.create("tiny", gpus=1).strategy is None


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        (dict(gpus=0), "gpus"),
        (dict(gpus=-2), "gpus"),
        (dict(gpus=1.5), "gpus"),
        (dict(gpus="2"), "gpus"),
        (dict(gpus=True), "gpus"),
        (dict(gpus=2, strategy="zero3"), "zero3"),
        (dict(gpus=2, strategy=3), "strategy"),
        (dict(gpus=2, strategy="ddp", offload=True), "offload"),
        (dict(gpus=2, offload="yes"), "offload"),
        (dict(gpus=2, framework="nybble"), "nybble-torch"),
        (dict(gpus=1, strategy="ddp", framework="nybble"), "runs on one GPU"),
        (dict(gpus=2, quant="bfloat16"), "4-bit"),
        (dict(gpus=2, framework="nybble-torch", quant="fp4"), "nf4"),
    ],
)
def test_bad_input_is_a_value_error_naming_it(kw: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        estimate_memory("tiny", seq_len=64, **kw)


def test_a_4bit_weight_that_does_not_split_over_the_gpus_is_named() -> None:
    # tiny's projections have 64 and 256 rows: not a multiple of 3 (shard_model refuses them)
    with pytest.raises(ValueError, match=r"decoder layer 0.*64 output rows.*3 GPUs"):
        estimate_memory("tiny", seq_len=64, gpus=3, framework="nybble-torch")
    # bitsandbytes' FSDP1 pads its flat parameter: any number of GPUs
    assert estimate_memory("tiny", seq_len=64, gpus=3).total_bytes > 0


# --- one GPU with a strategy: the single-GPU run plus the engine's extras -------------------


@pytest.mark.parametrize(
    ("framework", "kw"),
    [
        # mixed precision changes nothing when the LoRA parameters are in the compute dtype
        ("nybble-torch", dict(lora_dtype="bfloat16")),
        # FSDP1's storage dtype float32: the single-GPU recipe's float32 weights and LoRA
        ("peft-bnb", dict()),
    ],
)
def test_one_gpu_under_fsdp_holds_the_single_gpu_model_state(
    framework: str, kw: dict[str, Any]
) -> None:
    single = _live(_setup(**kw), framework)
    fsdp = _live(_setup(gpus=1, strategy="fsdp", **kw), framework)
    # after a step (zero_grad done) the gathers, reduce-scatters and gradients are gone: what
    # stays is the model state, tensor by tensor the single-GPU run's
    assert fsdp == single
    assert GATHERED_PARAMS not in fsdp and COMM_BUFFERS not in fsdp


@pytest.mark.parametrize("framework", ["peft-bnb", "nybble-torch"])
@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_ddp_is_one_gpus_model_state_plus_the_gradient_buckets(framework: str, gpus: int) -> None:
    single = _live(_setup(), framework)
    ddp = _live(_setup(gpus=gpus, strategy="ddp"), framework)
    buckets = 4 * _lora_elements(2)  # float32 gradients of every LoRA tensor, in buckets
    assert ddp == dict(single, **{COMM_BUFFERS: buckets})


def test_ddp_per_gpu_does_not_depend_on_the_gpus() -> None:
    two = estimate_memory(SHORT_70B, seq_len=256, gpus=2, strategy="ddp")
    four = estimate_memory(SHORT_70B, seq_len=256, gpus=4, strategy="ddp")
    assert two.breakdown == four.breakdown and two.total_bytes == four.total_bytes


def test_ddp_estimate_adds_the_buckets_to_the_single_gpu_one() -> None:
    single = estimate_memory(SHORT_70B, seq_len=256)
    ddp = estimate_memory(SHORT_70B, seq_len=256, gpus=2, strategy="ddp")
    buckets = ddp_buckets([4 * n for n in ddp.setup.lora_tensors()], reverse=True)
    rounded = sum(-(-b // 512) * 512 for b in buckets)
    # each bucket is one block: its request rounded to 512 bytes, or a block up to 1 MiB
    # larger that the allocator does not split (allocator.py)
    assert rounded <= ddp.breakdown[COMM_BUFFERS] <= rounded + len(buckets) * MiB
    for part in (QUANTIZED_WEIGHTS, QUANT_CONSTANTS, UNQUANTIZED_WEIGHTS, LORA_PARAMS):
        assert abs(ddp.breakdown[part] - single.breakdown[part]) <= 0.01 * single.breakdown[part]
    assert ddp.breakdown[NCCL_PART] == NCCL_WORKSPACE and single.breakdown[NCCL_PART] == 0


def test_one_gpu_fsdp_adds_only_the_documented_parts() -> None:
    single = estimate_memory(SHORT_70B, seq_len=256, framework="nybble-torch")
    one = estimate_memory(SHORT_70B, seq_len=256, framework="nybble-torch", strategy="fsdp")
    assert one.breakdown[NCCL_PART] == NCCL_WORKSPACE_MEASURED[1]
    assert one.breakdown[GATHERED_PARAMS] > 0  # FSDP2 copies even one GPU's shards out
    for part in (QUANTIZED_WEIGHTS, QUANT_CONSTANTS, UNQUANTIZED_WEIGHTS):
        assert abs(one.breakdown[part] - single.breakdown[part]) <= 0.01 * single.breakdown[part]
    assert one.total_bytes > single.total_bytes


# --- several GPUs: the shards, by hand ------------------------------------------------------


def test_fsdp2_shards_of_the_70b_shape_by_hand() -> None:
    n, layers = 4, 2
    live = _live(_setup(gpus=n), "nybble-torch")
    codes = sum(o * i // 2 for o, i in PROJ) * layers // n
    blocks = [o * i // 64 // n for o, i in PROJ]  # each rank's blocks, whole 256-block groups
    constants = layers * sum(b + 4 * (b // 256) for b in blocks)
    # dim 0 padded to ceil(rows / 4): the embeddings, the head, every norm (bf16, the load
    # dtype of nybble's recipe), the LoRA A [r, in] and B [out, r] (float32)
    unquantized = 2 * (2 * -(-V // n) * H + -(-H // n)) + layers * 2 * 2 * -(-H // n)
    lora = 4 * layers * sum(-(-R // n) * i + -(-o // n) * R for o, i in PROJ)
    assert live[QUANTIZED_WEIGHTS] == codes
    assert live[QUANT_CONSTANTS] == constants
    assert live[UNQUANTIZED_WEIGHTS] == unquantized
    assert live[LORA_PARAMS] == lora
    assert live[OPTIMIZER_STATES] == 2 * lora  # AdamW's two states of rank 0's shards
    assert GRADIENTS not in live  # zero_grad


def test_fsdp1_gradient_is_the_whole_flat_parameters_shard() -> None:
    # bf16 storage (the published FSDP-QLoRA recipe): every parameter of the Llama shape is a
    # multiple of 8 bf16 elements (16 bytes), so the flat parameter has no alignment padding
    n, layers = 2, 2
    s = _setup(gpus=n, lora_dtype="bfloat16")
    before_step = _live(s, "peft-bnb", until_phase="optimizer step")
    per_layer = sum(o * i // 4 for o, i in PROJ) + _lora_elements(1) + 2 * H  # bf16 elements
    assert before_step[GRADIENTS] == layers * per_layer * 2 // n
    after = _live(s, "peft-bnb")
    layer_shards = layers * per_layer * 2 // n
    root_shard = (2 * V * H + H) * 2 // n
    assert after[QUANTIZED_WEIGHTS] + after[LORA_PARAMS] + after[UNQUANTIZED_WEIGHTS] == (
        layer_shards + root_shard
    )
    # bitsandbytes' constants are no parameters: whole on every GPU
    single = _live(_setup(), "peft-bnb")
    assert after[QUANT_CONSTANTS] == single[QUANT_CONSTANTS]


def test_offload_moves_the_model_state_to_the_host() -> None:
    est = estimate_memory(SHORT_70B, seq_len=256, gpus=4, framework="nybble-torch", offload=True)
    on_gpu = _live(_setup(gpus=4), "nybble-torch")
    for part in (QUANTIZED_WEIGHTS, QUANT_CONSTANTS, UNQUANTIZED_WEIGHTS, LORA_PARAMS):
        assert est.breakdown[part] == 0
        assert est.host_breakdown[part] == on_gpu[part]
    assert est.breakdown[OPTIMIZER_STATES] == 0
    # AdamW's two states and its step's square roots, and the float32 sharded gradients
    assert est.host_breakdown[OPTIMIZER_STATES] == 3 * on_gpu[LORA_PARAMS]
    assert est.host_breakdown[GRADIENTS] == on_gpu[LORA_PARAMS]


def test_sharded_state_shrinks_with_the_gpus() -> None:
    for framework in ("nybble-torch", "peft-bnb"):
        prev: dict[str, int] | None = None
        for n in (1, 2, 4, 8):
            live = _live(_setup(gpus=n, strategy="fsdp"), framework)
            if prev is not None:
                for part in (QUANTIZED_WEIGHTS, UNQUANTIZED_WEIGHTS, LORA_PARAMS):
                    assert live[part] < prev[part], (framework, n, part)
                assert live[OPTIMIZER_STATES] <= prev[OPTIMIZER_STATES]
            prev = live


@pytest.mark.parametrize(
    ("framework", "kw"),
    [("nybble-torch", {}), ("peft-bnb", dict(lora_dtype="bfloat16")), ("peft-bnb", {})],
)
def test_the_per_gpu_total_falls_with_more_gpus(framework: str, kw: dict[str, Any]) -> None:
    cfg = dict(LLAMA_70B, num_hidden_layers=8)
    totals = [
        estimate_memory(cfg, seq_len=512, framework=framework, gpus=n, **kw).total_bytes
        for n in (2, 4, 8)
    ]
    assert totals == sorted(totals, reverse=True) and totals[0] > totals[-1]


@pytest.mark.parametrize(
    ("framework", "kw"),
    [("nybble-torch", {}), ("peft-bnb", dict(lora_dtype="bfloat16")), ("peft-bnb", {})],
)
def test_the_70b_shape_on_1_2_4_gpus(framework: str, kw: dict[str, Any]) -> None:
    """Llama-3.1-70B at 2048 tokens, r=16 all-linear, FSDP: each estimate for 2 and 4 GPUs
    in well under a second of CPU time, and each GPU holding less as the GPUs double."""
    totals = []
    for n in (1, 2, 4):
        t0 = time.process_time()
        est = estimate_memory(
            "llama-3.1-70b", seq_len=2048, framework=framework, gpus=n, strategy="fsdp", **kw
        )
        spent = time.process_time() - t0
        if n > 1:
            assert spent < 1.0, (n, spent)
        totals.append(est.total_bytes)
    assert totals[0] > totals[1] > totals[2], totals


def test_a_sharded_run_that_does_not_fit_is_offered_offload() -> None:
    est = estimate_memory(SHORT_70B, seq_len=256, gpus=2, framework="nybble-torch")
    off = estimate_memory(SHORT_70B, seq_len=256, gpus=2, framework="nybble-torch", offload=True)
    assert off.required_bytes < est.required_bytes
    found = {x.setting: x for x in est.suggestions(off.required_bytes)}
    assert found["offload"].required_bytes == off.required_bytes
    assert est.suggestions(est.required_bytes) == []


# --- the engines' rules, by hand ------------------------------------------------------------


def test_ddp_buckets_close_at_their_caps() -> None:
    mib = MiB
    sizes = [mib // 2, 6 * mib // 10, 30 * mib, 10 * mib, 10 * mib, 10 * mib, 3 * mib]
    assert DDP_FIRST_BUCKET == mib and DDP_BUCKET_CAP == 25 * mib
    # the first closes once it holds 1 MiB, the next ones 25 MiB; the rest is the last
    assert ddp_buckets(sizes) == [mib // 2 + 6 * mib // 10, 30 * mib, 30 * mib, 3 * mib]
    backward = [3 * mib, 30 * mib, 30 * mib, 6 * mib // 10 + mib // 2]
    assert ddp_buckets(sizes, reverse=True) == backward


def test_fsdp1_flat_parameter_alignment_and_padding() -> None:
    from nybble.memory.distributed import Param

    params = [Param(LORA_PARAMS, n, 1, 2) for n in (3, 5, 8)]
    # bf16: each parameter at a multiple of 8 elements (16 bytes): offsets 0, 8, 16; 24
    # elements, padded to a multiple of 5 GPUs: 25
    assert fsdp1_layout(params, 2, 5) == (25, [0, 8, 16])
    # float32: multiples of 4 elements: 0, 4 (3 padded to 4), 12 (9 padded to 12); 20
    assert fsdp1_layout(params, 4, 1) == (20, [0, 4, 12])


def test_nf4_shards_by_hand() -> None:
    # q_proj of the 70B shape on 4 GPUs: 2048 rows each, whole blocks and nested groups
    w = nf4_shard(8192, 8192, 64, True, 4)
    assert w.held == (8192 * 8192 // 2 // 4, 8192 * 8192 // 64 // 4, 8192 * 8192 // 64 // 256 // 4)
    assert w.in_place == (True, True, True) and w.widths == (1, 1, 4)
    # 6 rows of 40 on 2 GPUs: rank 0 has elements [0, 120) in blocks 0-1, rank 1 [120, 240)
    # in blocks 1-3 (block 1 is both's): codes [0, 64) and [32, 120), scales 2 and 3
    w = nf4_shard(6, 40, 64, False, 2)
    assert w.held == (88, 3) and w.whole == (120, 4) and w.in_place == (False, False)
    with pytest.raises(ValueError):
        nf4_shard(6, 40, 64, False, 4)


def test_nf4_shards_are_the_torch_layers_spans() -> None:
    torch = pytest.importorskip("torch")
    packed = pytest.importorskip("nybble.torch._packed")
    cases = [(6, 40, 64, True, 2), (1024, 8192, 64, True, 8), (96, 72, 32, False, 3)]
    for rows, cols, bs, dq, n in cases:
        layout = packed.Layout(rows, cols, bs, dq, 0.0, torch.bfloat16)
        w = nf4_shard(rows, cols, bs, dq, n)
        per = rows // n
        for k, kind in enumerate(layout.kinds()):
            spans = [layout.span(r * per, (r + 1) * per)[kind] for r in range(n)]
            assert w.held[k] == max(e - s for s, e in spans)
            assert w.whole[k] == layout.length(kind)
            assert w.in_place[k] == packed._contiguous(spans, w.held[k], layout.length(kind))


# --- the command line ---------------------------------------------------------------------


def test_cli_per_gpu_table_and_host_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "tiny", "-s", "64", "--gpus", "2", "--offload", "--gpu", "24"]) == 0
    out = capsys.readouterr().out
    assert "2 GPUs, strategy fsdp, CPU offload: every figure below is one GPU's" in out
    assert "gathered params" in out and "nccl workspace" in out
    assert "host memory (offload):" in out


def test_cli_single_gpu_table_has_no_distributed_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "tiny", "-s", "64"]) == 0
    out = capsys.readouterr().out
    assert "gathered params" not in out and "nccl workspace" not in out


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--gpus", "0"], "gpus"),
        (["--gpus", "1.5"], "gpus"),
        (["--gpus", "two"], "gpus"),
        (["--gpus", "2", "--strategy", "zero3"], "zero3"),
        (["--strategy", "ddp", "--offload"], "offload"),
        (["--gpus", "2", "--framework", "nybble"], "nybble-torch"),
    ],
)
def test_cli_bad_input_is_one_line(
    args: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", "tiny", "-s", "64", *args]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nybble estimate: error:")
    assert named in err and "Traceback" not in err


# --- against the runs measured on H200s ------------------------------------------------------

MEASURED_FSDP = json.loads(
    (Path(__file__).parents[1] / "fixtures" / "memory" / "fsdp_h200.json").read_text()
)


@pytest.mark.parametrize(
    "run", MEASURED_FSDP["runs"], ids=lambda r: f"{r['side']}-{r['gpus']}gpu-{r['run']}"
)
def test_fsdp_estimate_is_within_5_percent_of_the_measured_peaks(run: dict[str, Any]) -> None:
    """nybble-torch under FSDP2: both peaks and NVML's total within 5% (measured: 0.4%).
    peft-bnb under FSDP1: the allocated peak; its reserved peak holds the cached segments of
    the benchmark's whole-model load on every rank, which the low-memory load modelled here
    does not leave (docs/multi-gpu.md)."""
    config = MEASURED_FSDP["config"]
    nybble = run["side"] == "nybble"
    est = estimate_memory(
        dict(LLAMA_70B, num_hidden_layers=config["layers"]),
        framework="nybble-torch" if nybble else "peft-bnb",
        lora_dtype=MEASURED_FSDP["lora_dtype"][run["side"]],
        lora_r=config["r"],
        seq_len=config["seq"],
        gpus=run["gpus"],
        strategy="fsdp",
    )
    assert est.allocated_peak_bytes == pytest.approx(run["peak_allocated"], rel=0.05)
    if nybble:
        assert est.reserved_peak_bytes == pytest.approx(run["peak_reserved"], rel=0.05)
        assert est.total_bytes == pytest.approx(run["nvml"], rel=0.05)


@pytest.mark.parametrize(
    "run", MEASURED_FSDP["embedding_units_runs"], ids=lambda r: f"{r['gpus']}gpu"
)
def test_embedding_units_estimate_against_the_measured_peaks(run: dict[str, Any]) -> None:
    """shard_model(..., embedding_units=True): the allocated peak within 5% (measured: 0.4%);
    the reserved peak over, not under (measured: +12.6% at one GPU, +9.1% at two: how the
    allocator reuses the load's cached segments there is not traced yet; docs/estimator.md)."""
    est = estimate_memory(
        dict(LLAMA_70B, num_hidden_layers=MEASURED_FSDP["config"]["layers"]),
        framework="nybble-torch",
        lora_r=R,
        seq_len=MEASURED_FSDP["config"]["seq"],
        gpus=run["gpus"],
        strategy="fsdp",
        embedding_units=True,
    )
    assert est.allocated_peak_bytes == pytest.approx(run["peak_allocated"], rel=0.05)
    assert 1.0 <= est.reserved_peak_bytes / run["peak_reserved"] <= 1.15


def test_embedding_units_gather_one_end_at_a_time() -> None:
    """The embeddings and the head are gathered only around their own forward and backward
    (at the peak: the head's all-gather output and its unsharded copy, no embeddings); the
    default's root holds both, and in its backward their all-gather output beside them."""
    kw: dict[str, Any] = dict(seq_len=256, framework="nybble-torch", gpus=2, strategy="fsdp")
    default = estimate_memory(SHORT_70B, **kw)
    ends = estimate_memory(SHORT_70B, embedding_units=True, **kw)
    head = 2 * V * H  # one of them, gathered whole in bf16
    assert default.breakdown[GATHERED_PARAMS] >= 4 * head
    assert 2 * head <= ends.breakdown[GATHERED_PARAMS] < 2.01 * head
    assert ends.allocated_peak_bytes < default.allocated_peak_bytes
    for part in (QUANTIZED_WEIGHTS, UNQUANTIZED_WEIGHTS, LORA_PARAMS, OPTIMIZER_STATES):
        assert ends.breakdown[part] == default.breakdown[part]  # the same shards
    assert ends.to_dict()["settings"]["embedding_units"] is True


@pytest.mark.parametrize(
    "kw, named",
    [
        (dict(gpus=2, strategy="ddp", framework="nybble-torch"), "strategy='fsdp'"),
        (dict(gpus=2, framework="peft-bnb"), "shard_model's"),
        (dict(gpus=2, framework="nybble-torch", model="qwen3-0.6b"), "tie_word_embeddings"),
        (dict(gpus=2, framework="nybble-torch", embedding_units="yes"), "True or False"),
    ],
)
def test_embedding_units_bad_input_is_named(kw: dict[str, Any], named: str) -> None:
    model = kw.pop("model", SHORT_70B)
    kw.setdefault("embedding_units", True)
    with pytest.raises(ValueError, match=re.escape(named)):
        estimate_memory(model, seq_len=256, **kw)


def test_cli_embedding_units(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "llama-3.1-70b", "--gpus", "2", "--framework", "nybble-torch"]
    assert main([*args, "--seq-len", "256", "--embedding-units"]) == 0
    assert "embeddings as units" in capsys.readouterr().out


def test_embedding_units_are_suggested_when_a_sharded_run_does_not_fit() -> None:
    kw: dict[str, Any] = dict(seq_len=256, framework="nybble-torch", gpus=2)
    need = estimate_memory(SHORT_70B, embedding_units=True, **kw).required_bytes
    est = estimate_memory(SHORT_70B, gpu=need + 64 * MiB, **kw)  # fits only with them
    assert not est.fits()
    offered = {s.setting: s for s in est.suggestions()}
    assert offered["embedding_units"].value is True
    assert offered["embedding_units"].total_bytes < est.total_bytes
