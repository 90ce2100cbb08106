"""nybble's NF4 layers under DeepSpeed ZeRO-3, on the CPU with gloo and 2 processes
(docs/multi-gpu.md, "FSDP1 and DeepSpeed ZeRO-3: a storage dtype"): with the packed codes
stored as float32 (`set_quant_storage`), ZeRO-3 partitions every 4-bit weight like any other
parameter (each rank holds half of it, nothing outside a gather), gathers it for the forward
and backward, and a tiny Llama with PEFT's LoRA trains to the losses of one process on the
same global batches; bf16 mixed precision, which would cast the stored codes, is refused by
name. DeepSpeed's CPU accelerator compiles its shared-memory op with ninja on first use."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
nt = pytest.importorskip("nybble.torch")
# DeepSpeed's CPU accelerator (chosen when DeepSpeed is imported), whose JIT-built op needs
# ninja on the PATH (the environment's)
os.environ["DS_ACCELERATOR"] = "cpu"
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
if shutil.which("ninja") is None:
    pytest.skip("DeepSpeed's CPU ops need ninja", allow_module_level=True)

from nybble.torch import distributed as nd  # noqa: E402
from tests.torch.process_cases import free_port, save_llama  # noqa: E402

WORLD = 2
ROWS = 2  # sequences per rank and step
STEPS = 3
LR = 1e-2


def batches() -> list[Any]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (WORLD * ROWS, 12), generator=g) for _ in range(STEPS)]


def lora_model(path: Path) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=nt.NybbleConfig(double_quant=True), dtype=torch.float32
    )
    torch.manual_seed(1)  # PEFT draws lora_A from torch's generator: the same on every path
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    return peft.get_peft_model(model, nt.register_lora(lora))


def zero3(model: Any, bf16: bool = False) -> Any:
    import deepspeed

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    return engine


def _worker(rank: int, port: int, path: str, out: str) -> None:
    import deepspeed

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
    )
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=180))
    result: dict[str, Any] = {}
    try:
        engine = zero3(nd.set_quant_storage(lora_model(Path(path)), torch.float32))
        w = engine.module.base_model.model.model.layers[0].mlp.up_proj.base_layer.weight
        result["partition"] = [int(w.ds_numel), int(w.ds_tensor.numel()), int(w.numel())]
        losses = []
        for batch in batches():
            x = batch[rank * ROWS : (rank + 1) * ROWS]
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            value = loss.detach().clone()
            torch.distributed.all_reduce(value)
            losses.append(float(value) / WORLD)
        result["losses"] = losses
        engine = zero3(nd.set_quant_storage(lora_model(Path(path)), torch.float32), bf16=True)
        try:
            x = batches()[0][:ROWS]
            engine(input_ids=x, labels=x)
            result["bf16_error"] = None
        except nt.StorageDtypeError as e:
            result["bf16_error"] = str(e)
    except Exception:  # recorded for the test to show
        result["error"] = traceback.format_exc()
    finally:
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("llama"))


def test_zero3_partitions_the_4bit_weights_and_trains_like_one_process(
    checkpoint: Path, tmp_path: Path
) -> None:
    import torch.multiprocessing as mp

    model = lora_model(checkpoint)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    want = []
    for batch in batches():
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(float(loss.detach()))

    mp.spawn(_worker, args=(free_port(), str(checkpoint), str(tmp_path)), nprocs=WORLD)
    for rank in range(WORLD):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "error" not in got, got["error"]
        # up_proj's 128 x 64 codes (4,096 bytes) stored as 1,024 float32s: each rank holds
        # half, and nothing is gathered outside the forward and backward
        assert got["partition"] == [1024, 1024 // WORLD, 0]
        torch.testing.assert_close(got["losses"], want, rtol=1e-5, atol=1e-5)
        assert "DeepSpeed's fp16/bf16" in got["bf16_error"]
    assert want[-1] < want[0]
