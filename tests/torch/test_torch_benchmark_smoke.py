"""benchmarks/torch_gpu.py on the CPU at tiny shapes: every measured part but the compiled
ones (minutes of inductor on a small CPU; `python benchmarks/torch_gpu.py --device cpu
--tiny --sides nybble` runs those too), in this process, and the parent's bookkeeping
(parts, cross-side figures, the merged results file, the table, the deadline)."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from tests import ROOT

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("nybble.torch")

SCRIPT = ROOT / "benchmarks" / "torch_gpu.py"


@pytest.fixture(scope="module")
def bench() -> Any:
    spec = importlib.util.spec_from_file_location("torch_gpu_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:  # its siblings, as when run as a script
        patch.syspath_prepend(str(SCRIPT.parent))
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def args(bench: Any, tmp_path_factory: pytest.TempPathFactory) -> argparse.Namespace:
    folder = tmp_path_factory.mktemp("ckpt") / "llama"
    bench.write_checkpoint(bench.model_fields("llama-3.1-8b", 1, tiny=True), folder)
    return argparse.Namespace(
        folder=folder,
        device="cpu",
        double_quant=True,
        seq=16,
        steps=2,
        curve_steps=3,
        new_tokens=4,
    )


@pytest.mark.parametrize("part", ["train", "trainer", "curve", "generate", "profile"])
def test_each_part_runs_on_the_cpu(bench: Any, args: argparse.Namespace, part: str) -> None:
    rec = bench.WORKERS[part]("nybble", args, bench.Device("cpu"))
    assert rec["quantized_layers"] == 7
    json.dumps(rec)
    if part in ("train", "trainer"):
        assert rec["step_ms"] > 0 and "peak_reserved" not in rec
    if part == "curve":
        assert len(rec["losses"]) == 3 and rec["losses"][-1] < rec["losses"][0]
    if part == "generate":
        assert rec["tokens_per_s"] > 0 and len(rec["ids"]) == 4
    if part == "profile":
        assert rec["step_ms"] > 0 and rec["profiled_host_ms"] > 0 and rec["top_host"]
        assert "profiled_gpu_ms" not in rec  # no GPU: no GPU figures


def test_the_adapters_start_alike_whatever_the_global_generator(
    bench: Any, args: argparse.Namespace
) -> None:
    import torch

    dev = bench.Device("cpu")
    first, _ = bench.lora_model("nybble", args, dev)
    torch.manual_seed(123)
    torch.rand(1000)
    second, _ = bench.lora_model("nybble", args, dev)
    a = dict(first.named_parameters())
    b = dict(second.named_parameters())
    lora = [n for n in a if ".lora_" in n]
    assert lora and all(torch.equal(a[n], b[n]) for n in lora)
    assert any(a[n].abs().sum() > 0 for n in lora if ".lora_A." in n)
    assert all(a[n].abs().sum() == 0 for n in lora if ".lora_B." in n)


def test_parts_compare_summary_and_merged_file(bench: Any, tmp_path: Path) -> None:
    assert bench.parse_parts("train,compile") == ["train", "compile-generate", "compile-train"]
    curve = {
        "model": "m",
        "layers": 1,
        "part": "curve",
        "nybble": {"losses": [10.0, 9.0]},
        "bnb": {"losses": [10.05, 9.0]},
    }
    bench.compare(curve)
    assert curve["max_rel_diff"] == pytest.approx(0.05 / 10.05, rel=1e-3)
    assert curve["within_1_percent"]
    train = {
        "model": "m",
        "layers": 1,
        "part": "train",
        "nybble": {"step_ms": 50.0, "peak_reserved": 2**30},
        "bnb": {"error": "exit 1: ModuleNotFoundError: bitsandbytes"},
    }
    bench.compare(train)
    assert train["step_nybble_over_bnb"] is None
    table = bench.summary([curve, train])
    assert "max rel diff" in table and "error: m train bnb: exit 1: ModuleNotFound" in table
    out = tmp_path / "torch_gpu.json"
    bench.save(out, {}, [curve])
    bench.save(out, {}, [train, dict(curve, max_rel_diff=0.5)])
    records = json.loads(out.read_text())["records"]
    assert [r["part"] for r in records] == ["train", "curve"]
    assert records[1]["max_rel_diff"] == 0.5


def test_a_part_with_no_time_left_is_skipped(bench: Any, args: argparse.Namespace) -> None:
    ns = argparse.Namespace(min_part_s=20.0)
    rec = bench.spawn("nybble:train", args.folder, ns, left=5.0)
    assert rec["error"].startswith("skipped")
