"""Host time per call of nybble.torch's CUDA layers, against bitsandbytes' where it imports, on
the Llama-3.1-8B `gate_proj` shape (4096 -> 14336, NF4, double quantization, bfloat16):

- `Linear4bit` forward at 1 row (a decode step) and at 2048 rows (a training sequence),
  under `torch.no_grad()`;
- the PEFT QLoRA layer (LoRA r=16, alpha 32, no dropout, adapters in float32) forward and
  backward at 2048 rows, the forward under bf16 autocast as in a training step, x requiring
  grad (dx, dA and dB from `torch.autograd.grad`). Without PEFT the same products by hand:
  nybble's `torch.ops.nybble.qlora_linear`, bitsandbytes' layer plus s·(x Aᵀ) Bᵀ in torch.

    python benchmarks/torch_overhead_gpu.py [--out-dir DIR] [--calls 50] [--rounds 5]

Per case and side:
- `host_us`: the host's time to issue one call: a loop of `--calls` calls timed on the host
  after a synchronize, with no wait inside (few enough calls that the GPU's queue never
  fills), the median of `--rounds` loops;
- `event_us`: CUDA events around such a loop, per call: the stream's time, the larger of the
  host's issue time and the GPU's work;
- `gpu_us`: the calls captured in a CUDA graph and replayed, per call: the GPU's work alone
  (None where the capture fails).

nybble also runs its backend route (CuPy views, the backend's launches and cuBLAS: what every
call took before `nybble.torch._fastpath`) for comparison, and the 1-row forward through the
op (`torch.ops.nybble.matmul`) beside `Linear4bit`'s own call. Prints a table; writes
torch_overhead_gpu.json to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import nybble.torch as nt
from nybble.torch import _fastpath

IN, OUT, R, ALPHA = 4096, 14336, 16, 32
ROWS = (1, 2048)
DTYPE = torch.bfloat16
CUDA = "cuda"


def bnb_module() -> Any:
    try:
        import bitsandbytes

        return bitsandbytes
    except Exception:  # absent, or without a GPU build
        return None


def peft_module() -> Any:
    try:
        import peft

        return peft
    except Exception:
        return None


# --- timing -----------------------------------------------------------------------------------


def measure(fn: Callable[[], Any], calls: int, rounds: int) -> dict[str, Any]:
    """host_us, event_us and gpu_us of one call of `fn` (see the module's docstring)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as a later capture wants
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    hosts = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        hosts.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    events = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        events.append(start.elapsed_time(end) * 1e3 / calls)
    return {
        "host_us": round(statistics.median(hosts), 2),
        "event_us": round(statistics.median(events), 2),
        "gpu_us": graph_us(fn, calls),
    }


def graph_us(fn: Callable[[], Any], calls: int) -> float | None:
    """Per call of `calls` calls captured in one CUDA graph and replayed (the GPU alone)."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(3):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        del graph
        return round(statistics.median(times), 2)
    except Exception as e:  # a side whose calls do not capture
        print(f"  (no CUDA graph: {type(e).__name__}: {str(e)[:200]})", flush=True)
        torch.cuda.synchronize()
        return None


# --- the layers -------------------------------------------------------------------------------


def nybble_layer(linear: torch.nn.Linear) -> Any:
    return nt.Linear4bit.from_linear(linear, double_quant=True, compute_dtype=DTYPE).to(CUDA)


def bnb_layer(bnb: Any, linear: torch.nn.Linear) -> Any:
    layer = bnb.nn.Linear4bit(
        IN, OUT, bias=False, compute_dtype=DTYPE, compress_statistics=True, quant_type="nf4"
    )
    layer.load_state_dict(linear.state_dict())
    return layer.to(CUDA)


class One(torch.nn.Module):
    """A model of one projection, for PEFT to wrap."""

    def __init__(self, proj: Any) -> None:
        super().__init__()
        self.proj = proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def lora_call(side: str, layer: Any, peft: Any) -> tuple[Callable[[torch.Tensor], Any], list[Any]]:
    """The QLoRA layer's forward as a call of x, and its trainable adapter tensors [A, B]."""
    torch.manual_seed(1)
    if peft is not None:
        config = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["proj"], lora_dropout=0.0)
        if side == "nybble":
            config = nt.register_lora(config)
        model = peft.get_peft_model(One(layer), config)
        lora = model.base_model.model.proj
        a, b = lora.lora_A["default"].weight, lora.lora_B["default"].weight
        with torch.no_grad():
            a.data = a.data.float()
            b.data = (torch.randn_like(b, dtype=torch.float32) * 0.01).to(b.device)
        return lora, [a, b]
    a = (torch.randn(R, IN, device=CUDA) * 0.01).requires_grad_()
    b = (torch.randn(OUT, R, device=CUDA) * 0.01).requires_grad_()
    s = ALPHA / R
    if side == "nybble":

        def call(x: torch.Tensor) -> Any:
            return torch.ops.nybble.qlora_linear(x, None, *layer.weight_args(), a, b, s, None)

        return call, [a, b]

    def bnb_call(x: torch.Tensor) -> Any:
        return layer(x) + s * ((x @ a.t()) @ b.t())

    return bnb_call, [a, b]


def train_step(call: Callable[[torch.Tensor], Any], params: list[Any], x: torch.Tensor) -> Any:
    dy = torch.randn(*x.shape[:-1], OUT, device=CUDA, dtype=DTYPE)

    def step() -> Any:
        with torch.autocast("cuda", dtype=DTYPE):
            y = call(x)
        return torch.autograd.grad(y, [x, *params], dy)

    return step


# --- the run ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    bnb, peft = bnb_module(), peft_module()
    linear = torch.nn.Linear(IN, OUT, bias=False, dtype=DTYPE)
    sides: dict[str, Any] = {"nybble": nybble_layer(linear)}
    cases: list[dict[str, Any]] = []
    if bnb is not None:
        try:
            sides["bitsandbytes"] = bnb_layer(bnb, linear)
        except Exception as e:  # a build without this GPU's kernels
            cases.append({"side": "bitsandbytes", "case": "load", "error": repr(e)[:500]})

    def record(case: str, side: str, fn: Callable[[], Any], calls: int) -> None:
        print(f"{case} / {side} ...", flush=True)
        try:
            found = measure(fn, calls, args.rounds)
        except Exception as e:
            found = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        found.update(case=case, side=side)
        cases.append(found)
        print(f"  {json.dumps(found)}", flush=True)

    # Few enough calls of the long ones that the GPU's queue of launches never fills.
    long_calls = min(args.calls, 20)
    for rows in ROWS:
        calls = args.calls if rows == 1 else long_calls
        x = torch.randn(1, rows, IN, device=CUDA, dtype=DTYPE)
        case = f"Linear4bit forward, {rows} row{'s' if rows > 1 else ''}"
        for side, layer in sides.items():
            with torch.no_grad():
                record(case, side, lambda layer=layer, x=x: layer(x), calls)
        ours = sides["nybble"]
        with torch.no_grad():
            if rows == 1:
                record(
                    case,
                    "nybble (through the op)",
                    lambda ours=ours, x=x: torch.ops.nybble.matmul(x, *ours.weight_args()),
                    calls,
                )
            step = backend_route(lambda ours=ours, x=x: ours(x))
            record(case, "nybble (backend route)", step, calls)

    x = torch.randn(1, 2048, IN, device=CUDA, dtype=DTYPE, requires_grad=True)
    case = "QLoRA layer forward + backward, 2048 rows"
    for side, layer in sides.items():
        call, params = lora_call(side, layer, peft)
        record(case, side, train_step(call, params, x), long_calls)
        if side == "nybble":
            step = backend_route(train_step(call, params, x))
            record(case, "nybble (backend route)", step, long_calls)

    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "bitsandbytes": getattr(bnb, "__version__", None),
        "peft": getattr(peft, "__version__", None),
        "shape": [OUT, IN],
        "calls": args.calls,
        "rounds": args.rounds,
        "cases": cases,
    }


def backend_route(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn with nybble's ops on the backend route: the fast route switched off around each
    call (its ops decline, and the layers' own calls go to the ops)."""
    eager = _fastpath.eager

    def call() -> Any:
        _fastpath._unavailable = True
        _fastpath.eager = _never
        try:
            return fn()
        finally:
            _fastpath._unavailable = False
            _fastpath.eager = eager

    return call


def _never(x: Any) -> bool:
    return False


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['device']}, torch {result['torch']}, bitsandbytes {result['bitsandbytes']}",
        f"{'case':44} {'side':26} {'host us':>9} {'event us':>9} {'gpu us':>9}",
    ]
    for c in result["cases"]:
        if "error" in c:
            lines.append(f"{c['case']:44} {c['side']:26} {c['error']}")
            continue
        gpu = "-" if c["gpu_us"] is None else f"{c['gpu_us']:9.1f}"
        lines.append(
            f"{c['case']:44} {c['side']:26} {c['host_us']:9.1f} {c['event_us']:9.1f} {gpu:>9}"
        )
    by = {(c["case"], c["side"]): c for c in result["cases"] if "error" not in c}
    for case in dict.fromkeys(c["case"] for c in result["cases"]):
        ours, theirs = by.get((case, "nybble")), by.get((case, "bitsandbytes"))
        if ours and theirs:
            lines.append(
                f"{case}: bitsandbytes / nybble host {theirs['host_us'] / ours['host_us']:.2f}x, "
                f"event {theirs['event_us'] / ours['event_us']:.2f}x"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA build of torch and a GPU")
    result = run(args)
    print(table(result), flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "torch_overhead_gpu.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
