"""nybble.torch on torch.distributed, on the CPU with gloo and 2 processes (docs/multi-gpu.md):
a tiny Llama with NF4 weights and PEFT's LoRA trains, under FSDP2 (`shard_model`) and under
DDP (`data_parallel`), to the losses of one process training on the same global batches, and
saves the same adapter (as PEFT's files, from rank 0).

The runs, in one pair of processes (started once, to keep the file fast):
- FSDP2 over a model loaded per rank (`load_sharded`: each rank quantizes its rows only),
  double-quantized scales, gradient checkpointing, the adapter saved;
- FSDP2 over a model loaded per rank from a checkpoint stored 4-bit (`load_sharded` reading
  only its rows' codes and scales): the same weights, bit for bit, and the same training;
- FSDP2 over a model loaded whole (`from_pretrained` with NybbleConfig), with CPU offload;
- FSDP2 with bfloat16 mixed precision for the LoRA parameters (trains; near the float32
  losses);
- DDP, the adapter saved;
- FSDP1 with the codes stored as float32 (`set_quant_storage`), and a mixed-precision cast of
  them refused by name.
Single-process tests cover FSDP2 as torch <= 2.11 builds its sharded parameters (emulated on
the torch that runs them: uint8 parameters made with the default requires_grad=True), NF4Weight's
pieces and gathers (uneven block and group boundaries), the rows `load_sharded` reads of a
4-bit checkpoint (uneven block and group boundaries; bad entries named), the storage dtype
checks and the adapter's atomic save."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import traceback
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
nt = pytest.importorskip("nybble.torch")
dist = pytest.importorskip("torch.distributed")

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from nybble.torch import distributed as nd  # noqa: E402
from nybble.torch._packed import NF4Weight  # noqa: E402
from nybble.torch.linear import StorageDtypeError  # noqa: E402
from tests.torch.process_cases import free_port, llama_config, save_llama  # noqa: E402

WORLD = 2
STEPS = 3
LR = 1e-2
SEQ = 12
#: Global batch per step: WORLD ranks x ROWS sequences.
ROWS = 2


def batches() -> list[Any]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (WORLD * ROWS, SEQ), generator=g) for _ in range(STEPS)]


def lora_config() -> Any:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)


def peft_model(model: Any) -> Any:
    torch.manual_seed(1)  # PEFT draws lora_A from torch's generator: the same on every path
    return peft.get_peft_model(model, nt.register_lora(lora_config()))


def loaded(path: Path, dq: bool) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=nt.NybbleConfig(double_quant=dq), dtype=torch.float32
    )


def train(model: Any, ids: list[Any], rank: int | None, params: Any = None) -> list[float]:
    """STEPS AdamW steps; the loss of each step (averaged over the ranks when distributed)."""
    model.train()
    opt = torch.optim.AdamW(
        params if params is not None else [p for p in model.parameters() if p.requires_grad],
        lr=LR,
    )
    losses = []
    for batch in ids:
        x = batch if rank is None else batch[rank * ROWS : (rank + 1) * ROWS]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if rank is not None:
            dist.all_reduce(value)
            value /= WORLD
        losses.append(float(value))
    return losses


# --- the distributed runs ---------------------------------------------------------------------


def _fsdp_sharded_load(rank: int, path: Path, out: Path) -> dict[str, Any]:
    mesh = nd.default_mesh()
    model = nd.load_sharded(
        path, mesh, quantization_config=nt.NybbleConfig(double_quant=True), dtype=torch.float32
    )
    held = {
        n: list(m.weight.rows_held)
        for n, m in model.named_modules()
        if isinstance(m, nt.Linear4bit)
    }
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = peft_model(model)
    nd.shard_model(model, mesh)
    shard = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    info = {
        "held": held,
        "local_type": type(shard.to_local()).__name__,
        "local_rows": list(shard.to_local()._box.held),
    }
    info["losses"] = train(model, batches(), rank)
    nd.save_adapter(model, out / "fsdp_dq")
    return info


def _held_arrays(model: Any) -> dict[str, list[Any]]:
    return {
        n: [t for t in m.weight._box.arrays.values() if t is not None]
        for n, m in model.named_modules()
        if isinstance(m, nt.Linear4bit)
    }


def _fsdp_from_4bit(rank: int, path: Path, out: Path) -> dict[str, Any]:
    """Loaded per rank from the checkpoint stored 4-bit (its own config: double quantization),
    against the same rows quantized from the float checkpoint."""
    mesh = nd.default_mesh()
    model = nd.load_sharded(path / "nf4", mesh, dtype=torch.float32)
    quantized = nd.load_sharded(
        path, mesh, quantization_config=nt.NybbleConfig(double_quant=True), dtype=torch.float32
    )
    ours, want = _held_arrays(model), _held_arrays(quantized)
    info: dict[str, Any] = {
        "layers": len(ours),
        "held": {n: list(m.weight.rows_held) for n, m in model.named_modules() if n in ours},
        "differ": [
            n
            for n in want
            if len(ours[n]) != len(want[n])
            or not all(torch.equal(a, b) for a, b in zip(ours[n], want[n], strict=True))
        ],
    }
    model = peft_model(model)
    nd.shard_model(model, mesh)
    info["losses"] = train(model, batches(), rank)
    return info


def _fsdp_offload(rank: int, path: Path, out: Path) -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy  # noqa: F401 - offload=True uses it

    model = peft_model(loaded(path, dq=False))
    nd.shard_model(model, offload=True, pin_memory=False)
    return {"losses": train(model, batches(), rank)}


def _fsdp_embedding_units(rank: int, path: Path, out: Path) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule

    model = peft_model(loaded(path, dq=False))
    nd.shard_model(model, embedding_units=True)
    units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    return {"losses": train(model, batches(), rank), "units": units}


def _fsdp_mixed_precision(rank: int, path: Path, out: Path) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = peft_model(loaded(path, dq=False))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    nd.shard_model(model, mp_policy=mp)
    dtypes: set[str] = set()

    def record(module: Any, args: Any, output: Any) -> None:
        dtypes.add(str(module.lora_A["default"].weight.dtype))

    model.base_model.model.model.layers[0].mlp.up_proj.register_forward_hook(record)
    return {"losses": train(model, batches(), rank), "lora_dtypes": sorted(dtypes)}


def _ddp(rank: int, path: Path, out: Path) -> dict[str, Any]:
    model = peft_model(loaded(path, dq=False))
    ddp = nd.data_parallel(model)
    ignored = sorted(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    info = {"losses": train(ddp, batches(), rank), "ignored": len(ignored)}
    nd.save_adapter(ddp, out / "ddp")
    return info


def _fsdp1(rank: int, path: Path, out: Path) -> dict[str, Any]:
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    def wrap(model: Any, **kw: Any) -> Any:
        policy = functools.partial(
            lambda_auto_wrap_policy,
            lambda_fn=lambda m: type(m).__name__ == "LlamaDecoderLayer",
        )
        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=policy,
            use_orig_params=True,
            device_id=torch.device("cpu"),
            **kw,
        )

    model = nd.set_quant_storage(peft_model(loaded(path, dq=False)), torch.float32)
    info: dict[str, Any] = {"losses": train(wrap(model), batches(), rank)}
    # bfloat16 mixed precision would cast the float32-stored codes: refused, by name.
    model = nd.set_quant_storage(peft_model(loaded(path, dq=False)), torch.float32)
    cast = wrap(model, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    try:
        x = batches()[0][:ROWS]
        cast(input_ids=x, labels=x)
        info["cast_error"] = None
    except StorageDtypeError as e:
        info["cast_error"] = str(e)
    return info


RUNS = {
    "fsdp_dq": _fsdp_sharded_load,
    "fsdp_4bit": _fsdp_from_4bit,
    "fsdp_offload": _fsdp_offload,
    "fsdp_ends": _fsdp_embedding_units,
    "fsdp_mp": _fsdp_mixed_precision,
    "ddp": _ddp,
    "fsdp1": _fsdp1,
}


def _worker(rank: int, port: int, path: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120)
    )
    results: dict[str, Any] = {}
    try:
        for name, run in RUNS.items():
            try:
                results[name] = run(rank, Path(path), Path(out))
            except Exception:  # recorded for the test to show; the other runs still go
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = save_llama(tmp_path_factory.mktemp("llama"))
    loaded(path, dq=True).save_pretrained(path / "nf4")  # the same model stored 4-bit
    return path


@pytest.fixture(scope="module")
def runs(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path]:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("runs")
    mp.spawn(_worker, args=(free_port(), str(checkpoint), str(out)), nprocs=WORLD, join=True)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return ranks[0], ranks[1], out


@pytest.fixture(scope="module")
def reference(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Any]:
    """One process, the whole global batch: losses and the adapter, per double_quant."""
    out = {}
    for dq in (False, True):
        model = peft_model(loaded(checkpoint, dq))
        losses = train(model, batches(), None)
        out[dq] = (losses, nd.adapter_state(model))
    return out


def _ok(result: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in result, result["error"]
    return result


def _adapter(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(path / "adapter_model.safetensors")


def _same_adapter(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Equal within float32 sums taken in another order, as AdamW's normalised steps carry
    them (a gradient near zero changes its step most: 1e-4 against steps of 1e-2)."""
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-3, atol=1e-4, msg=k)


# --- FSDP2 ----------------------------------------------------------------------------------------


def test_fsdp_loaded_per_rank_trains_like_one_process(runs: Any, reference: Any) -> None:
    r0, r1, out = runs
    want_losses, want_adapter = reference[True]
    for r, res in enumerate((r0, r1)):
        info = _ok(res["fsdp_dq"])
        torch.testing.assert_close(info["losses"], want_losses, rtol=1e-5, atol=1e-5)
        assert info["local_type"] == "NF4Weight"
        q = info["held"]["model.layers.0.self_attn.q_proj"]
        assert q == [32 * r, 32 * (r + 1)]  # 64 rows: each rank quantized its half only
        assert info["held"]["model.layers.1.mlp.down_proj"] == [32 * r, 32 * (r + 1)]
    assert want_losses[-1] < want_losses[0]
    _same_adapter(_adapter(out / "fsdp_dq"), want_adapter)
    config = json.loads((out / "fsdp_dq" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4


def test_fsdp_loaded_per_rank_from_a_4bit_checkpoint_trains_like_one_process(
    runs: Any, reference: Any
) -> None:
    r0, r1, _ = runs
    for r, res in enumerate((r0, r1)):
        info = _ok(res["fsdp_4bit"])
        assert info["layers"] == 14 and info["differ"] == []  # the rows' arrays, bit for bit
        assert info["held"]["model.layers.1.mlp.up_proj"] == [64 * r, 64 * (r + 1)]
        torch.testing.assert_close(info["losses"], reference[True][0], rtol=1e-5, atol=1e-5)


def test_fsdp_with_cpu_offload_trains_like_one_process(runs: Any, reference: Any) -> None:
    for res in runs[:2]:
        info = _ok(res["fsdp_offload"])
        torch.testing.assert_close(info["losses"], reference[False][0], rtol=1e-5, atol=1e-5)


def test_fsdp_with_embedding_units_trains_like_one_process(runs: Any, reference: Any) -> None:
    for res in runs[:2]:
        info = _ok(res["fsdp_ends"])
        torch.testing.assert_close(info["losses"], reference[False][0], rtol=1e-5, atol=1e-5)
        inner = "base_model.model."
        assert info["units"] == [
            "",
            inner + "model.embed_tokens",
            inner + "model.layers.0",
            inner + "model.layers.1",
            inner + "lm_head",
        ]


def test_embedding_units_refuse_tied_or_missing_embeddings() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    config = llama_config()
    config.tie_word_embeddings = True
    tied = transformers.AutoModelForCausalLM.from_config(config)
    assert tied.get_input_embeddings().weight is tied.get_output_embeddings().weight
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="share their weight"):
            nd.shard_model(tied, embedding_units=True)
        with pytest.raises(ValueError, match="input and output embeddings"):
            nd.shard_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), embedding_units=True)
    finally:
        dist.destroy_process_group()


def test_fsdp_mixed_precision_computes_lora_in_bfloat16(runs: Any, reference: Any) -> None:
    want = reference[False][0]
    for res in runs[:2]:
        info = _ok(res["fsdp_mp"])
        assert info["lora_dtypes"] == ["torch.bfloat16"]
        assert all(abs(a - b) < 0.02 * abs(b) for a, b in zip(info["losses"], want, strict=True))
        assert info["losses"][-1] < info["losses"][0]


def test_fsdp_on_one_rank_trains_like_one_process(checkpoint: Path, reference: Any) -> None:
    """A one-rank mesh (FSDP copies only the first all-gather input there)."""
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = peft_model(loaded(checkpoint, dq=True))
        nd.shard_model(model)
        losses = train(model, batches(), None)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(losses, reference[True][0], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs CUDA and NCCL"
)
def test_fsdp_on_one_gpu_from_float_and_4bit_checkpoints_trains_like_no_fsdp(
    checkpoint: Path,
) -> None:
    """FSDP2 on one GPU (NCCL) over models loaded per rank from the float checkpoint and from
    the same model stored 4-bit: the same losses, to float32 rounding, as the model loaded
    whole on the GPU without FSDP (PEFT draws lora_A from the GPU's generator on every path)."""
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")

    def losses(model: Any) -> list[float]:
        ids = [b.cuda() for b in batches()]
        return train(model, ids, None)

    gpu = torch.device("cuda", torch.cuda.current_device())
    whole = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint,
        quantization_config=nt.NybbleConfig(double_quant=True),
        dtype=torch.float32,
        device_map={"": gpu},
    )
    want = losses(peft_model(whole))
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=gpu)
    got = {}
    try:
        mesh = nd.default_mesh()
        for name, path in (("float", checkpoint), ("4bit", checkpoint / "nf4")):
            config = nt.NybbleConfig(double_quant=True) if name == "float" else None
            model = nd.load_sharded(path, mesh, quantization_config=config, dtype=torch.float32)
            model = peft_model(model)
            nd.shard_model(model, mesh)
            got[name] = losses(model)
    finally:
        dist.destroy_process_group()
    assert got["float"] == got["4bit"]  # the same codes and scales, bit for bit
    torch.testing.assert_close(got["float"], want, rtol=1e-5, atol=1e-5)


class _NnAsInOldTorch:
    """torch.nn as FSDP2's `_fsdp_param` module sees it, with `nn.Parameter(data,
    requires_grad=r)` built as torch <= 2.11 builds the sharded parameter: with the default
    requires_grad (True), then `requires_grad_(r)`."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.nn, name)

    @staticmethod
    def Parameter(data: Any = None, requires_grad: Any = None) -> Any:
        p = torch.nn.Parameter(data)
        if requires_grad is not None:
            p.requires_grad_(requires_grad)
        return p


@pytest.fixture
def old_fsdp2_sharded_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP2's `FSDPParam._init_sharded_param` as in torch <= 2.11 (`nn.Parameter(dtensor)`,
    then `requires_grad_`), on whichever torch runs the tests."""
    import importlib

    module = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_param")
    original = module.FSDPParam._init_sharded_param

    def init(self: Any, *args: Any, **kwargs: Any) -> Any:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(module, "nn", _NnAsInOldTorch())
            return original(self, *args, **kwargs)

    monkeypatch.setattr(module.FSDPParam, "_init_sharded_param", init)


def test_fsdp_trains_where_fsdp2_builds_parameters_with_the_default_requires_grad(
    checkpoint: Path, reference: Any, tmp_path: Path, old_fsdp2_sharded_parameter: None
) -> None:
    """torch <= 2.11's FSDP2 builds each sharded parameter with requires_grad=True before
    freezing it, which torch refuses for the uint8 NF4 weights: shard_model builds them
    frozen, and the run (loaded per rank, forward, backward, AdamW, the adapter saved)
    matches one process."""
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        quant = nt.NybbleConfig(double_quant=True)
        model = peft_model(nd.load_sharded(checkpoint, quantization_config=quant))
        with pytest.MonkeyPatch.context() as m:  # the emulation is the failure, without the fix
            m.setattr(nd, "_integer_parameters_frozen_by_default", contextlib.nullcontext)
            with pytest.raises(RuntimeError, match="floating point dtype can require gradients"):
                nd.shard_model(model)
        model = peft_model(nd.load_sharded(checkpoint, quantization_config=quant))
        nd.shard_model(model)
        weight = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
        assert type(weight.to_local()).__name__ == "NF4Weight" and not weight.requires_grad
        losses = train(model, batches(), None)
        nd.save_adapter(model, tmp_path / "adapter")
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(losses, reference[True][0], rtol=1e-5, atol=1e-5)
    _same_adapter(_adapter(tmp_path / "adapter"), reference[True][1])


def test_uint8_parameters_are_built_frozen_while_sharding() -> None:
    """What shard_model's fully_shard calls see: `nn.Parameter(t)` of a uint8 tensor (an
    NF4Weight, or a plain one) is frozen; float tensors and an explicit requires_grad go to
    torch unchanged; torch's constructor is back afterwards. FSDP2 (every version) moves a
    tensor-subclass parameter that is not on the mesh's device this way."""
    from torch.distributed.fsdp._fully_shard._fsdp_init import _move_states_to_device

    new = torch.nn.Parameter.__dict__["__new__"]
    layer = nt.Linear4bit.from_linear(torch.nn.Linear(64, 32)).pack_()
    with pytest.raises(RuntimeError, match="floating point dtype"):
        torch.nn.Parameter(layer.weight)  # torch's own constructor
    with nd._integer_parameters_frozen_by_default():
        for t in (layer.weight, torch.zeros(3, dtype=torch.uint8)):
            p = torch.nn.Parameter(t)
            assert isinstance(p, torch.nn.Parameter) and not p.requires_grad
            assert type(p) is (type(t) if type(t) is not torch.Tensor else torch.nn.Parameter)
        assert torch.nn.Parameter(torch.zeros(2)).requires_grad
        assert torch.nn.Parameter().requires_grad
        assert not torch.nn.Parameter(torch.zeros(2), requires_grad=False).requires_grad
        with pytest.raises(RuntimeError, match="floating point dtype"):
            torch.nn.Parameter(layer.weight, requires_grad=True)
        w = layer.weight
        _move_states_to_device([w], [], torch.device("meta"))
        assert w.device.type == "meta" and not w.requires_grad
        assert isinstance(layer.weight, NF4Weight) and layer.weight is w
    assert torch.nn.Parameter.__dict__["__new__"] is new
    with pytest.raises(RuntimeError, match=r"(?i)only tensors of floating point"):
        torch.nn.Parameter(torch.zeros(3, dtype=torch.uint8))


# --- DDP, FSDP1 -----------------------------------------------------------------------------------


def test_ddp_trains_like_one_process_and_saves_the_adapter(runs: Any, reference: Any) -> None:
    r0, r1, out = runs
    want_losses, want_adapter = reference[False]
    for res in (r0, r1):
        info = _ok(res["ddp"])
        torch.testing.assert_close(info["losses"], want_losses, rtol=1e-5, atol=1e-5)
        assert info["ignored"] == 2 * 7 * 2  # weight + absmax of every 4-bit layer
    _same_adapter(_adapter(out / "ddp"), want_adapter)
    loaded_back = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_config(llama_config()),
        out / "ddp",
    )
    assert loaded_back is not None


def test_fsdp1_with_float_storage_trains_and_refuses_a_cast(runs: Any, reference: Any) -> None:
    for res in runs[:2]:
        info = _ok(res["fsdp1"])
        torch.testing.assert_close(info["losses"], reference[False][0], rtol=1e-5, atol=1e-5)
        assert info["cast_error"] is not None
        assert "stored as float32" in info["cast_error"] and "bfloat16" in info["cast_error"]


# --- single process -------------------------------------------------------------------------------


class _Mesh:
    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank = world, rank

    def size(self) -> int:
        return self.world

    def get_local_rank(self) -> int:
        return self.rank


def _gather(w: Any, world: int) -> Any:
    """What FSDP2 does with a weight: chunk, pad-copy, pre-all-gather per rank, concatenate,
    post-all-gather."""
    inputs, meta = [], None
    for r, piece in enumerate(torch.chunk(w, world, dim=0)):
        local = w.new_zeros(piece.shape)
        local.narrow(0, 0, piece.shape[0]).copy_(piece)
        got, meta = local.fsdp_pre_all_gather(_Mesh(world, r), w.shape, w.stride(), None, None)
        inputs.append(got)
    outs = tuple(torch.cat([inputs[r][k] for r in range(world)]) for k in range(len(inputs[0])))
    full, fresh = w.fsdp_post_all_gather(outs, meta, torch.uint8)
    return full, fresh, outs, meta


@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("shape", [(64, 64), (66, 70), (8, 4096), (96, 96)])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_nf4weight_shards_gather_back_bit_for_bit(shape: Any, dq: bool, world: int) -> None:
    if shape[0] % world:
        pytest.skip("uneven rows")
    torch.manual_seed(0)
    layer = nt.Linear4bit.from_linear(torch.nn.Linear(shape[1], shape[0]), double_quant=dq)
    want = layer.weight_args()[:3]
    w = layer.pack_().weight
    assert isinstance(w, NF4Weight) and w.dtype == torch.uint8 and tuple(w.shape) == shape
    full, fresh, outs, meta = _gather(w, world)
    for got in (full.arrays(), None):
        if got is None:  # FSDP's later gathers write into the same tensors
            for t in fresh:
                t.untyped_storage().resize_(0)
                t.untyped_storage().resize_(t.numel() * t.itemsize)
            assert w.fsdp_post_all_gather(outs, meta, torch.uint8, out=full) is None
            got = full.arrays()
        for g, e in zip(got, want, strict=True):
            assert (g is None and e is None) or torch.equal(g, e)
    # the gathered inputs are 4-bit codes and their scales: about n/2 bytes, never 16-bit
    total = sum(t.numel() * t.element_size() for t in outs)
    assert total <= shape[0] * shape[1] // 2 * 1.2 + 4 * 64 * world


def test_nf4weight_refuses_casts_and_arithmetic() -> None:
    layer = nt.Linear4bit.from_linear(torch.nn.Linear(64, 32, bias=False)).pack_()
    w = layer.weight
    with pytest.raises(TypeError, match="cannot be cast"):
        w.to(torch.bfloat16)
    with pytest.raises(TypeError, match="not an operation"):
        torch.add(w, 1)
    layer.to(torch.bfloat16)  # a module cast leaves the codes alone
    assert isinstance(layer.weight, NF4Weight) and layer.weight.dtype == torch.uint8
    x = torch.randn(2, 64)
    y = layer(x)
    layer.unpack_()
    assert torch.equal(layer(x), y)


def test_a_shard_outside_fsdp_is_a_clear_error() -> None:
    layer = nt.Linear4bit.from_linear(torch.nn.Linear(64, 32)).pack_()
    piece = torch.chunk(layer.weight, 2, dim=0)[1]
    layer.weight = torch.nn.Parameter(piece, requires_grad=False)  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"holds rows \[16, 32\) of \[0, 32\)"):
        layer(torch.randn(1, 64))


@pytest.mark.parametrize("storage", [torch.float32, torch.float16, torch.bfloat16])
def test_float_storage_keeps_the_codes_and_refuses_a_cast(storage: Any) -> None:
    torch.manual_seed(0)
    layer = nt.Linear4bit.from_linear(torch.nn.Linear(63, 5, bias=False), double_quant=True)
    x = torch.randn(3, 63)
    y = layer(x)
    state = layer.state_dict()
    layer.set_quant_storage(storage)
    assert layer.weight.dtype == storage and layer.quant_storage == storage
    assert torch.equal(layer(x), y)
    for cast in (torch.float64, torch.float16, torch.bfloat16, torch.float32):
        layer.to(cast)  # module casts move the bytes without converting them
        assert layer.weight.dtype == storage
    assert torch.equal(layer(x), y)
    assert set(layer.state_dict()) == set(state)
    for k, v in layer.state_dict().items():  # bitsandbytes' uint8 state, unchanged
        assert torch.equal(v, state[k]), k
    other = torch.float16 if storage != torch.float16 else torch.bfloat16
    layer.weight.data = layer.weight.data.to(other)  # what an engine's mixed precision does
    with pytest.raises(StorageDtypeError, match=f"stored as {str(storage)[6:]}"):
        layer(x)
    layer.weight.data = torch.zeros(3, 1, dtype=storage)  # a shard that was not gathered
    with pytest.raises(StorageDtypeError, match="not gathered"):
        layer(x)


class _RankMesh(_Mesh):
    """One rank of a `world`-rank mesh, as load_sharded asks of it (a 4-bit checkpoint's rows
    are read with no collective)."""

    device_type = "cpu"

    def get_group(self) -> None:
        return None


@pytest.fixture
def one_process_group() -> Any:
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _uneven_4bit_checkpoint(path: Path, dq: bool) -> Any:
    """A Llama whose ranks' rows cut blocks (rows of 70 and 600 elements) and, under double
    quantization, groups of nested scales (a rank's 300 rows of gate_proj: 328 blocks), saved
    4-bit; returns the model loaded whole."""
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        hidden_size=70,
        intermediate_size=600,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=64,
        tie_word_embeddings=False,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path / "float")
    whole = loaded(path / "float", dq)
    whole.save_pretrained(path / "nf4")
    return whole


@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("world", [1, 2])
def test_load_sharded_reads_its_rows_of_a_4bit_checkpoint_bit_for_bit(
    one_process_group: Any, tmp_path: Path, dq: bool, world: int
) -> None:
    whole = _uneven_4bit_checkpoint(tmp_path, dq)
    wants = {n: m for n, m in whole.named_modules() if isinstance(m, nt.Linear4bit)}
    assert len(wants) == 7
    for rank in range(world):
        model = nd.load_sharded(tmp_path / "nf4", _RankMesh(world, rank), dtype=torch.float32)
        for name, layer in model.named_modules():
            if not isinstance(layer, nt.Linear4bit):
                continue
            want = wants[name]
            assert (layer.blocksize, layer.double_quant) == (64, dq)
            per = want.out_features // world
            a, b = rank * per, (rank + 1) * per
            w = layer.weight
            assert w.rows_held == (a, b)
            span = w._box.layout.span(a, b)
            kinds = ("codes", "absmax", "absmax2")
            full = dict(zip(kinds, want.pack_().weight.arrays(), strict=True))
            for kind, got in w._box.arrays.items():
                if full[kind] is None:
                    assert got is None
                    continue
                s0, s1 = span[kind]
                assert torch.equal(got, full[kind][s0:s1]), (name, kind)
            assert layer.offset == want.offset
        torch.testing.assert_close(
            model.model.embed_tokens.weight, whole.model.embed_tokens.weight, rtol=0, atol=0
        )


def _edit(path: Path, change: Any) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(path / "model.safetensors")
    change(state)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_load_sharded_names_what_is_wrong_with_a_4bit_checkpoint(
    one_process_group: Any, tmp_path: Path
) -> None:
    from nybble.errors import FormatError

    _uneven_4bit_checkpoint(tmp_path, dq=True)
    nf4 = tmp_path / "nf4"
    key = "model.layers.0.mlp.down_proj.weight"
    original = (nf4 / "model.safetensors").read_bytes()

    def attempt() -> None:
        nd.load_sharded(nf4, _RankMesh(2, 1), dtype=torch.float32)

    def restore() -> None:
        (nf4 / "model.safetensors").write_bytes(original)

    def scales_as_float16(state: dict[str, Any]) -> None:
        state[f"{key}.absmax"] = state[f"{key}.absmax"].to(torch.float16)

    def nan_nested_scale(state: dict[str, Any]) -> None:
        state[f"{key}.nested_absmax"][-1] = float("nan")

    def fp4(state: dict[str, Any]) -> None:
        from nybble import formats

        blob = state.pop(f"{key}.quant_state.bitsandbytes__nf4")
        meta = json.loads(bytes(blob.tolist()))
        meta["quant_type"] = "fp4"
        data = json.dumps(meta).encode()
        state[f"{key}.quant_state.bitsandbytes__fp4"] = torch.tensor(list(data), dtype=torch.uint8)
        state[f"{key}.quant_map"] = torch.from_numpy(formats.values("fp4").copy())

    def codes_cut(state: dict[str, Any]) -> None:
        state[key] = state[key][:-1].clone()

    def codes_as_int8(state: dict[str, Any]) -> None:  # bytes of another storage dtype
        state[key] = state[key].view(torch.int8)

    cases = [
        (scales_as_float16, FormatError, f"{key}.absmax.*float16"),
        (nan_nested_scale, FormatError, f"{key}.nested_absmax"),
        (fp4, FormatError, "holds NF4 weights; this one is fp4"),
        (codes_cut, FormatError, f"{key}.*bytes"),
        (codes_as_int8, FormatError, f"{key}.*int8, expected uint8"),
    ]
    for change, error, match in cases:
        _edit(nf4, change)
        with pytest.raises(error, match=match):
            attempt()
        restore()
    # another model's config over these weights: the shape is named
    config = json.loads((nf4 / "config.json").read_text())
    config["intermediate_size"] = 640
    (nf4 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"gate_proj.weight has shape \[600, 70\]"):
        attempt()


def test_quant_storage_rejects_other_dtypes() -> None:
    layer = nt.Linear4bit.from_linear(torch.nn.Linear(64, 8))
    with pytest.raises(ValueError, match="quant_storage must be one of"):
        layer.set_quant_storage(torch.int32)
    with pytest.raises(ValueError, match="quant_storage must be one of"):
        nd.set_quant_storage(torch.nn.Sequential(layer), torch.float64)


def test_save_adapter_is_atomic_and_replaces_files(checkpoint: Path, tmp_path: Path) -> None:
    model = peft_model(loaded(checkpoint, dq=False))
    target = tmp_path / "adapter"
    nd.save_adapter(model, target)
    first = _adapter(target)
    assert sorted(os.listdir(target)) == ["adapter_config.json", "adapter_model.safetensors"]
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.fill_(0.5)
    nd.save_adapter(model, target)  # over the old one: each file replaced whole
    second = _adapter(target)
    assert all(torch.all(v == 0.5) for k, v in second.items() if "lora_B" in k)
    assert sorted(first) == sorted(second)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match="not a directory"):
        nd.save_adapter(model, tmp_path / "file")


def test_helpers_need_an_initialized_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    model = torch.nn.Sequential(nt.Linear4bit.from_linear(torch.nn.Linear(64, 8)))
    with pytest.raises(ValueError, match="not initialized"):
        nd.shard_model(model)
    with pytest.raises(ValueError, match="not initialized"):
        nd.data_parallel(model)
