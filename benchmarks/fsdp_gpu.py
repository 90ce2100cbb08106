"""Sharded QLoRA on several GPUs of one host: nybble under FSDP2 against PEFT + bitsandbytes
under FSDP (issue 43; docs/multi-gpu.md), per-GPU peak memory and tokens per second at 1, 2
and 4 GPUs, each configuration a fresh `torchrun`.

    python3 benchmarks/fsdp_gpu.py [--gpus 1,2,4] [--sides nybble,bnb] [--layers 8]
        [--seq 2048] [--steps 4] [--offload] [--units decoder|decoder,ends] [--work-dir DIR]
        [--out-dir DIR] [--profile] [--floor] [--segments]

Model: the Llama-3.1-70B shape (hidden 8192, intermediate 28672, 64 heads, 8 KV heads,
head_dim 128, vocabulary 128256, llama3 rope) with `--layers` decoder layers (default 8: a
bf16 checkpoint of all 80 layers is 141 GB, more than the GPU hosts' disks), random weights
(std 0.02) written once as a sharded bf16 safetensors folder that every run loads.
Training step per GPU: batch 1 of `--seq` tokens (each rank its own), LoRA r=16 alpha 32 on
all seven projections, no dropout, NF4 with double quantization, bf16 compute, gradient
checkpointing (use_reentrant=False), torch AdamW, the loss from `labels`; the median of
`--steps` steps after two warm-ups (a step's time is the slowest rank's), tokens/s =
GPUs x seq / step. Memory: each rank's `max_memory_reserved` / `max_memory_allocated` over one
steady step, and NVML's figure for the process where pynvml is present; the record keeps
every rank's and the largest, beside the estimator's figure for the same run
(`estimate_memory(..., gpus=N, strategy="fsdp")`) and its error (target: within 5%).

- nybble: `nybble.torch.distributed.load_sharded` (each rank quantizes only its rows of each
  weight), PEFT with `register_lora`, `shard_model` (FSDP2's `fully_shard` per decoder layer
  and the root; the 4-bit weights all-gathered as 4-bit data), `MixedPrecisionPolicy(
  param_dtype=bf16, reduce_dtype=fp32)` for the float32 LoRA parameters; `--offload` adds
  FSDP2's CPUOffloadPolicy; `--units decoder,ends` is `shard_model(...,
  embedding_units=True)` (the embeddings and the head units of their own).
- bnb: the published FSDP-QLoRA recipe: `BitsAndBytesConfig(load_in_4bit, nf4, double
  quant, bnb_4bit_compute_dtype=bf16, bnb_4bit_quant_storage=bf16)` loaded in bf16 by every
  rank, PEFT's LoRA, FSDP1 (`FullyShardedDataParallel`: one unit per decoder layer,
  `use_orig_params=True`, `MixedPrecision(bf16)`; bitsandbytes' 4-bit weights lose their
  quantization state under FSDP2); `--offload` adds FSDP1's CPUOffload. Every parameter of
  a unit is in the storage dtype, bf16, as FSDP1 flattens a unit into one tensor of one
  dtype: the LoRA weights are made with `get_peft_model(..., autocast_adapter_dtype=False)`
  (PEFT creates them in the 4-bit layers' compute dtype, bf16; its default would upcast
  them to float32: "Must flatten tensors with uniform dtype"), and `uniform_dtype` checks
  every parameter (it would cast a float one left in another dtype, and refuses a 4-bit
  weight stored otherwise). So the bnb side's LoRA weights and AdamW state are bf16 (the
  nybble side's float32, computed in bf16); they are a few MB either way.

`--cpu` runs the same code on the CPU with gloo (`--shape tiny` for a model that fits;
timings and memory meaningless): a smoke test of the script; the bnb side there needs a
bitsandbytes with a CPU 4-bit path (0.50.2 has one).

`--profile` adds each rank's kernel time of one more step by kernel family (torch's profiler:
dense products, attention, communication, 4-bit decoding, other); `--floor` times the step's
dense bf16 products alone on one GPU (the floor of any implementation computing in bf16);
`--segments` records where each of the allocator's segments came from (a diagnosis of the
reserved peak: it slows the run).

Writes fsdp_gpu.json (into benchmarks/results/ by default; fsdp_cpu_smoke.json with --cpu;
fsdp_gpu_decoder_ends.json with `--units decoder,ends`), merged with the records of an earlier
run of the same configuration there (a record per side and GPU count), so that the GPU counts
can be run one command at a time. With `--work-dir` the checkpoint is kept there and reused by
the next command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _shapes import shapes, write_checkpoint

HERE = Path(__file__).parent
RESULTS = HERE / "results"
R = 16

SHAPES: dict[str, dict[str, Any]] = {
    **shapes("llama-3.1-70b"),
    "tiny": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    ),
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# --- one configuration, under torchrun ------------------------------------------------------------


def _nvml_bytes(index: int) -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid():
                return int(p.usedGpuMemory)
    except Exception:  # NVML is optional: the figure is then absent
        return None
    return None


def _lora(side: str) -> Any:
    from peft import LoraConfig

    lora = LoraConfig(
        r=R, lora_alpha=2 * R, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    if side == "nybble":
        import nybble.torch

        lora = nybble.torch.register_lora(lora)
    return lora


def build_nybble(folder: Path, device: Any, offload: bool, units: str = "decoder") -> Any:
    import torch
    from peft import get_peft_model
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import nybble.torch
    from nybble.torch import distributed as nd

    mesh = nd.default_mesh()
    compute = torch.bfloat16 if device.type == "cuda" else None
    model = nd.load_sharded(
        folder,
        mesh,
        quantization_config=nybble.torch.NybbleConfig(double_quant=True, compute_dtype=compute),
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        device=device,
    )
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, _lora("nybble"))
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if device.type == "cuda" else None, reduce_dtype=torch.float32
    )
    # the decoder layers and the root; "decoder,ends": the embeddings and the head too
    ends = units == "decoder,ends"
    nd.shard_model(model, mesh, mp_policy=mp, offload=offload, embedding_units=ends)
    return model


def uniform_dtype(model: Any, dtype: Any) -> None:
    """Puts every parameter of `model` in `dtype` (FSDP1 flattens each unit's parameters into
    one tensor of one dtype): a float parameter in another dtype (a LoRA weight or a norm
    left in float32) is cast; a bitsandbytes 4-bit weight (`Params4bit`, its codes stored as
    `bnb_4bit_quant_storage`) in another dtype is a ValueError, never cast (that would
    convert its codes)."""
    import torch

    for name, p in model.named_parameters():
        if p.dtype == dtype:
            continue
        if type(p).__name__ == "Params4bit" or not torch.is_floating_point(p):
            raise ValueError(f"{name}: {type(p).__name__} of {p.dtype}, not {dtype} (not cast)")
        p.data = p.data.to(dtype)


def build_bnb(folder: Path, device: Any, offload: bool) -> Any:
    import functools

    import torch
    from peft import get_peft_model
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), quantization_config=bnb, dtype=torch.bfloat16, device_map={"": device}
    )
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # The LoRA weights in the storage dtype: PEFT creates them in the 4-bit layers' compute
    # dtype (bf16), and would upcast them to float32 (autocast_adapter_dtype=True, its
    # default), which FSDP1 cannot flatten with the bf16 units.
    model = get_peft_model(model, _lora("bnb"), autocast_adapter_dtype=False)
    uniform_dtype(model, torch.bfloat16)
    layer = type(model.base_model.model.model.layers[0])
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer})
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=policy,
        use_orig_params=True,
        mixed_precision=MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16
        ),
        cpu_offload=CPUOffload(offload_params=offload),
        device_id=device,
        limit_all_gathers=True,
    )


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    cpu = args.cpu
    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    if cpu:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    else:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    rec: dict[str, Any] = {"side": args.worker, "gpus": world}
    if args.segments and not cpu:  # from the start: the cache's segments are made early
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python")
    try:
        t0 = time.perf_counter()
        if args.worker == "nybble":
            model = build_nybble(args.folder, device, args.offload, args.units)
        else:
            model = build_bnb(args.folder, device, args.offload)
        rec["load_s"] = round(time.perf_counter() - t0, 1)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)
        vocab = SHAPES[args.shape]["vocab_size"]
        generator = torch.Generator().manual_seed(1 + rank)

        def sync() -> None:
            if not cpu:
                torch.cuda.synchronize()

        def step() -> float:
            ids = torch.randint(0, vocab, (1, args.seq), generator=generator).to(device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        for _ in range(2):
            step()
        times, losses = [], []
        for _ in range(args.steps):
            sync()
            dist.barrier()
            t = time.perf_counter()
            losses.append(step())
            sync()
            # on the device: NCCL reduces only device tensors
            elapsed = torch.tensor([time.perf_counter() - t], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(float(elapsed))
        memory: dict[str, Any] = {}
        if not cpu:
            torch.cuda.reset_peak_memory_stats()
            step()
            sync()
            memory = {
                "peak_reserved": torch.cuda.max_memory_reserved(),
                "peak_allocated": torch.cuda.max_memory_allocated(),
                "nvml": _nvml_bytes(local),
            }
        if args.segments and not cpu:
            memory["segments"] = segment_origins(torch.cuda.memory._snapshot())
        if args.profile and not cpu:
            from _timing import kernel_profile

            memory["kernel_profile"] = kernel_profile(lambda: (step(), sync()))
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, memory)
        # FSDP2's parameters are DTensors (numel: the whole tensor's); FSDP1's with
        # use_orig_params are this rank's part of each (numel: summed over the ranks).
        trainable = sum(p.numel() for p in params)
        if args.worker == "bnb":
            counts: list[Any] = [None] * world
            dist.all_gather_object(counts, trainable)
            trainable = sum(counts)
        step_s = statistics.median(times)
        rec.update(
            step_ms=round(step_s * 1e3, 1),
            tokens_per_s=round(world * args.seq / step_s, 1),
            tokens_per_s_per_gpu=round(args.seq / step_s, 1),
            losses=[round(v, 4) for v in losses],
            trainable=trainable,
            per_rank=gathered,
        )
        if not cpu:
            rec["peak_reserved_max"] = max(m["peak_reserved"] for m in gathered)
            rec["peak_allocated_max"] = max(m["peak_allocated"] for m in gathered)
            rec["device"] = torch.cuda.get_device_name()
        rec["torch"] = torch.__version__
    except Exception as e:  # recorded; the driver goes on with the other runs
        import traceback

        rec["error"] = f"rank {rank}: {type(e).__name__}: {e}"
        traceback.print_exc()
    if rank == 0:
        print("RESULT " + json.dumps(rec), flush=True)
    dist.destroy_process_group()


# --- the driver: never touches the GPU ---------------------------------------------------------


def run(
    side: str, gpus: int, folder: Path, args: argparse.Namespace, left: float
) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={gpus}", __file__, "--worker", side, "--folder", str(folder)]
    cmd += ["--seq", str(args.seq), "--steps", str(args.steps), "--shape", args.shape]
    cmd += ["--offload"] if args.offload else []
    cmd += ["--units", args.units]
    cmd += ["--cpu"] if args.cpu else []
    cmd += ["--profile"] if args.profile else []
    cmd += ["--segments"] if args.segments else []
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(left, 30.0))
    except subprocess.TimeoutExpired:
        return {"side": side, "gpus": gpus, "error": "timed out"}
    found = _result(p.stdout)
    if found is not None:
        return found
    return {"side": side, "gpus": gpus, "error": f"exit {p.returncode}: {p.stderr.strip()[-2000:]}"}


def _result(stdout: str) -> dict[str, Any] | None:
    """The record a worker printed as its `RESULT {...}` line, if it did."""
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    return None


def estimate(side: str, gpus: int, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """nybble's estimate of one GPU's peaks in this run (`estimate_memory(..., gpus,
    strategy="fsdp")`; the bnb side's LoRA weights in bf16, as the recipe makes them), and
    its error against the largest measured peak of the ranks (target: within 5%)."""
    from nybble import estimate_memory

    try:
        est = estimate_memory(
            str(folder),
            framework="nybble-torch" if side == "nybble" else "peft-bnb",
            lora_dtype="float32" if side == "nybble" else "bfloat16",
            lora_r=R,
            seq_len=args.seq,
            gpus=gpus,
            strategy="fsdp",
            offload=args.offload,
            embedding_units=args.units == "decoder,ends",
        )
    except (KeyError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return dict(
        reserved_peak=est.reserved_peak_bytes,
        allocated_peak=est.allocated_peak_bytes,
        total=est.total_bytes,
    )


def segment_origins(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """Each segment torch's allocator reserved (cudaMalloc) during the run, in order: its size,
    its stream and the innermost Python frames that asked for it (to check the estimator's
    model of the reserved peak against what the engines did)."""
    out = []
    for trace in snapshot.get("device_traces", []):
        for event in trace:
            if event.get("action") != "segment_alloc":
                continue
            frames = [
                f"{'/'.join(Path(f['filename']).parts[-2:])}:{f['line']}:{f['name']}"
                for f in event.get("frames", [])
                if "/torch/utils/" not in f["filename"] and "/torch/autograd/" not in f["filename"]
            ]
            out.append(dict(size=event["size"], stream=event["stream"], frames=frames[:6]))
    return out


def gemm_floor(args: argparse.Namespace) -> None:
    """The step's dense bf16 products alone on one GPU, the floor of any implementation that
    computes in bf16 what both sides compute: per decoder-layer projection three products of
    `--seq` tokens (forward, the checkpointed recompute, the input gradient; a frozen base
    weight has no weight gradient), and two for the head (no recompute). The 4-bit decoding,
    LoRA, attention, norms, the loss and the communication come on top."""
    import torch

    fields = SHAPES[args.shape]
    h, i, d = fields["hidden_size"], fields["intermediate_size"], fields["head_dim"]
    q, kv = fields["num_attention_heads"] * d, fields["num_key_value_heads"] * d
    shapes = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    weights = {s: torch.randn(s, **bf16) for s in {*shapes, (fields["vocab_size"], h)}}
    xs = {n: torch.randn(args.seq, n, **bf16) for n in {h, i, q, kv, fields["vocab_size"]}}

    def products() -> None:
        for _ in range(args.layers):
            for out, inp in shapes:
                w = weights[(out, inp)]
                for _ in range(2):  # forward and its recompute
                    xs[inp] @ w.t()
                xs[out] @ w  # the input gradient
        head = weights[(fields["vocab_size"], h)]
        xs[h] @ head.t()
        xs[fields["vocab_size"]] @ head

    products()
    times = []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        products()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    print("RESULT " + json.dumps({"gemm_floor_ms": round(statistics.median(times), 1)}))


def estimate_errors(rec: dict[str, Any]) -> None:
    """The estimate's relative error against the measured peaks (largest rank's)."""
    est = rec.get("estimate", {})
    for kind in ("reserved", "allocated"):
        measured, modelled = rec.get(f"peak_{kind}_max"), est.get(f"{kind}_peak")
        if measured and modelled:
            rec[f"estimate_error_{kind}"] = round(modelled / measured - 1, 4)


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """nybble against bnb at each GPU count, and each side's scaling from its fewest GPUs."""
    by = {(r["side"], r["gpus"]): r for r in records if "error" not in r}
    out: dict[str, Any] = {}
    for gpus in sorted({r["gpus"] for r in records}):
        ours, theirs = by.get(("nybble", gpus)), by.get(("bnb", gpus))
        if ours and theirs:
            row: dict[str, Any] = {
                "tokens_per_s_vs_bnb": round(ours["tokens_per_s"] / theirs["tokens_per_s"], 2)
            }
            if ours.get("peak_reserved_max") and theirs.get("peak_reserved_max"):
                row["memory_vs_bnb"] = round(
                    ours["peak_reserved_max"] / theirs["peak_reserved_max"], 3
                )
            out[f"{gpus}_gpus"] = row
    for side in ("nybble", "bnb"):
        runs = sorted((g, r) for (s, g), r in by.items() if s == side)
        if len(runs) > 1:
            base_g, base = runs[0]
            out[f"{side}_scaling_from_{base_g}"] = {
                str(g): round(r["tokens_per_s"] / base["tokens_per_s"], 2) for g, r in runs[1:]
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Needs CUDA GPUs with torch, transformers, peft, CuPy and nybble[torch]; "
        "bitsandbytes for the bnb side.",
    )
    parser.add_argument("--gpus", default="1,2,4", help="GPU counts, comma-separated: %(default)s")
    parser.add_argument("--sides", default="nybble,bnb", help="comma-separated: %(default)s")
    parser.add_argument("--shape", default="llama-3.1-70b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per GPU per step")
    parser.add_argument("--steps", type=int, default=4, help="timed training steps")
    parser.add_argument("--offload", action="store_true", help="FSDP's CPU offload on both sides")
    parser.add_argument(
        "--units",
        default="decoder",
        choices=["decoder", "decoder,ends"],
        help="nybble's FSDP2 units besides the root: the decoder layers (shard_model's "
        "default), or also the embeddings and the head (default: %(default)s)",
    )
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU (a smoke test)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="each rank's kernel time of one more step, by kernel family (torch's profiler)",
    )
    parser.add_argument(
        "--segments",
        action="store_true",
        help="record where each of the allocator's segments came from (slows the run: a "
        "diagnosis, not a timing)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also time the step's dense bf16 products alone on one GPU (the floor of both sides)",
    )
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="keep (and reuse) the checkpoint here"
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--deadline-s", type=float, default=560.0, help="for all the runs")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "floor":
        gemm_floor(args)
        return
    if args.worker:
        worker(args)
        return
    sides = [s for s in args.sides.split(",") if s]
    if set(sides) - {"nybble", "bnb"}:
        parser.error("--sides takes nybble and bnb")
    counts = [int(g) for g in args.gpus.split(",") if g]
    deadline = time.monotonic() + args.deadline_s
    records = []
    with contextlib.ExitStack() as stack:
        if args.work_dir is None:
            base = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        else:
            base = args.work_dir
        folder = base / f"{args.shape}-{args.layers}"
        if not (folder / "config.json").is_file():  # written last: the checkpoint is whole
            t0 = time.perf_counter()
            fields = dict(SHAPES[args.shape], num_hidden_layers=args.layers)
            write_checkpoint(dict(fields, torch_dtype="bfloat16"), folder, per_layer=True)
            print(f"checkpoint written in {time.perf_counter() - t0:.0f} s", flush=True)
        for gpus in counts:
            for side in sides:
                rec = run(side, gpus, folder, args, deadline - time.monotonic())
                rec.setdefault("side", side)
                rec.setdefault("gpus", gpus)
                if not args.cpu and "error" not in rec:
                    rec["estimate"] = estimate(side, gpus, folder, args)
                    estimate_errors(rec)
                print(json.dumps(rec), flush=True)
                records.append(rec)
    floor = None
    if args.floor and not args.cpu:  # in a process of its own: the driver stays off the GPUs
        cmd = [sys.executable, __file__, "--worker", "floor", "--shape", args.shape]
        cmd += ["--layers", str(args.layers), "--seq", str(args.seq), "--steps", str(args.steps)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        floor = _result(p.stdout) or {"error": p.stderr[-2000:]}
        print(json.dumps(floor), flush=True)
    config = dict(
        shape=args.shape,
        layers=args.layers,
        seq=args.seq,
        batch_per_gpu=1,
        r=R,
        alpha=2 * R,
        targets="all-linear",
        double_quant=True,
        compute_dtype="bfloat16",
        gradient_checkpointing=True,
        offload=args.offload,
        units=args.units,
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = "fsdp_cpu_smoke" if args.cpu else "fsdp_gpu"
    if args.units != "decoder":  # another configuration: a file of its own
        name += "_" + args.units.replace(",", "_")
    out = args.out_dir / f"{name}.json"
    command = " ".join(["python3", *sys.argv])
    for rec in records:
        rec["command"] = command
    # an earlier command's records (and floor) of the same configuration stay
    earlier = json.loads(out.read_text()) if out.is_file() else {}
    if earlier.get("config") == config:
        done = {(r["side"], r["gpus"]) for r in records}
        kept = [r for r in earlier.get("records", []) if (r["side"], r["gpus"]) not in done]
        records = sorted(kept + records, key=lambda r: (r["gpus"], r["side"]))
        floor = floor or earlier.get("floor")
    result = {"config": config, "records": records, "summary": summary(records)}
    if floor is not None:
        result["floor"] = floor
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
