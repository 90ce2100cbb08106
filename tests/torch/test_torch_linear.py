"""nybble.torch.Linear4bit on the CPU: its codes are nybble's (bitsandbytes' CPU codes), its
forward and gradients those of the dequantized weight, its state dict bitsandbytes' own
(compared with nybble.bnb.export_state and with states bitsandbytes 0.50.2 wrote,
tests/fixtures/bnb_cpu.npz), round trips through state dicts and safetensors files, moves
and casts that keep the scales exact, and errors naming what is wrong. Where bitsandbytes is
importable and can quantize here, `replace_bnb` against its layer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import nybble
from nybble.errors import FormatError
from tests import FIXTURES

torch = pytest.importorskip("torch")
nt = pytest.importorskip("nybble.torch")

FIXTURES = np.load(FIXTURES / "bnb_cpu.npz")


def bits(a: Any) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def fixture_state(dq: int) -> dict[str, Any]:
    prefix = f"state_dq{dq}/"
    return {k[len(prefix) :]: FIXTURES[k] for k in FIXTURES.files if k.startswith(prefix)}


def torch_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}


@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_linear_holds_nybbles_codes_and_computes_with_them(dq: bool, dtype: Any) -> None:
    torch.manual_seed(1)
    linear = torch.nn.Linear(130, 48).to(dtype)
    layer = nt.Linear4bit.from_linear(linear, double_quant=dq)
    w = linear.weight.detach()
    host = w.float().numpy().astype(ml_dtypes.bfloat16) if dtype == torch.bfloat16 else w.numpy()
    q = nybble.quantize(host, double_quant=dq)
    np.testing.assert_array_equal(layer.weight.view(-1).numpy(), q.codes)
    assert layer.double_quant == dq and layer.weight_dtype == dtype
    assert layer.weight.requires_grad is False and layer.weight.shape == (130 * 48 // 2, 1)
    assert torch.equal(layer.bias, linear.bias)
    deq = torch.from_numpy(q.dequantize("float32"))
    np.testing.assert_array_equal(bits(layer.dequantize(torch.float32).numpy()), bits(deq.numpy()))
    x = torch.randn(2, 3, 130, dtype=dtype, requires_grad=True)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (2, 3, 48)
    want = (x.detach().float() @ deq.T + linear.bias.detach().float()).to(dtype)
    torch.testing.assert_close(y, want, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-3)
    y.float().sum().backward()
    torch.testing.assert_close(
        x.grad.float(), (torch.ones(2, 3, 48) @ deq).to(dtype).float(), rtol=2e-2, atol=1e-2
    )


def test_a_new_layer_is_nn_linears_initialization_quantized() -> None:
    torch.manual_seed(0)
    layer = nt.Linear4bit(64, 32)
    assert isinstance(layer, torch.nn.Linear)
    w = layer.dequantize(torch.float32)
    bound = 1 / np.sqrt(64)  # kaiming_uniform(a=sqrt(5)) as nn.Linear
    assert 0.8 * bound < float(w.abs().max()) <= bound * 1.0001
    assert float(layer.bias.detach().abs().max()) <= bound
    # Not yet loaded: a placeholder of the float weight to come, in the dtype loaders read it
    # in (transformers 5.17 casts the checkpoint's tensor to it), and bitsandbytes' key alone.
    meta = nt.Linear4bit(64, 32, device="meta", dtype=torch.bfloat16)
    assert meta.weight.is_meta and meta.absmax.is_meta
    assert meta.weight.dtype == torch.bfloat16 and meta.weight.shape == (32, 64)
    assert set(meta.state_dict()) == {"weight", "bias"}


@pytest.mark.parametrize("dq", [False, True])
def test_state_dict_is_bitsandbytes_format(dq: bool) -> None:
    """The keys, dtypes, shapes and bytes nybble.bnb.export_state writes (which
    tests/bnb/test_bitsandbytes.py checks against bitsandbytes' own), under the module's prefix."""
    torch.manual_seed(2)
    linear = torch.nn.Linear(40, 48, bias=False).to(torch.bfloat16)
    model = torch.nn.Sequential(nt.Linear4bit.from_linear(linear, double_quant=dq))
    state = model.state_dict()
    host = linear.weight.detach().float().numpy().astype(ml_dtypes.bfloat16)
    want = nybble.bnb.export_state(nybble.quantize(host, double_quant=dq), prefix="0.weight")
    assert set(state) == set(want)
    for key, value in want.items():
        got = state[key].numpy()
        assert got.dtype == value.dtype and got.shape == value.shape, key
        np.testing.assert_array_equal(bits(got), bits(value), err_msg=key)
    meta = json.loads(state["0.weight.quant_state.bitsandbytes__nf4"].numpy().tobytes())
    assert meta["dtype"] == "bfloat16" and meta["shape"] == [48, 40]


@pytest.mark.parametrize("dq", [0, 1])
def test_loads_what_bitsandbytes_saved_and_saves_it_back(dq: int) -> None:
    """A state dict bitsandbytes 0.50.2 wrote (48x40 bf16, tests/fixtures/make_bnb_fixtures.py)
    loads bit for bit (its dequantized bfloat16 values), and saves back the same bytes."""
    theirs = fixture_state(dq)
    layer = nt.Linear4bit(40, 48, bias=False, device="meta")
    result = layer.load_state_dict(
        torch_state({k: v for k, v in theirs.items() if k.startswith("weight")})
    )
    assert not result.missing_keys and not result.unexpected_keys
    assert layer.double_quant == bool(dq) and layer.weight_dtype == torch.bfloat16
    got = layer.dequantize().view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(got.ravel(), bits(theirs["dequantized_bf16_bits"]).ravel())
    x = torch.randn(5, 40)
    deq = layer.dequantize(torch.float32)
    torch.testing.assert_close(layer(x), x @ deq.T, rtol=1e-5, atol=1e-5)
    for key, value in layer.state_dict().items():
        np.testing.assert_array_equal(bits(value.numpy()), bits(theirs[key]), err_msg=key)


@pytest.mark.parametrize("dq", [False, True])
def test_round_trips_through_state_dicts_and_files(dq: bool, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    torch.manual_seed(3)
    a = nt.Linear4bit(72, 40, double_quant=dq)
    x = torch.randn(3, 72)
    save_file(a.state_dict(), tmp_path / "layer.safetensors")
    b = nt.Linear4bit(72, 40, double_quant=not dq)  # the state decides
    b.load_state_dict(load_file(tmp_path / "layer.safetensors"))
    assert b.double_quant == dq
    assert torch.equal(b(x), a(x))
    for key, value in a.state_dict().items():
        assert torch.equal(b.state_dict()[key], value), key


def test_a_float_weight_in_the_state_dict_is_quantized_on_load() -> None:
    torch.manual_seed(4)
    linear = torch.nn.Linear(64, 32)
    layer = nt.Linear4bit(64, 32, double_quant=True)
    layer.load_state_dict(linear.state_dict())
    want = nt.Linear4bit.from_linear(linear, double_quant=True)
    assert torch.equal(layer.weight, want.weight) and torch.equal(layer.absmax, want.absmax)
    assert torch.equal(layer.bias, linear.bias)


def test_strict_loading_reports_missing_and_unexpected_keys() -> None:
    layer = nt.Linear4bit(64, 32)
    state = layer.state_dict()
    state["weight.unknown"] = torch.zeros(1)
    state["extra"] = torch.zeros(1)
    del state["bias"]
    with pytest.raises(RuntimeError) as e:
        layer.load_state_dict(state)
    assert "weight.unknown" in str(e.value) and "extra" in str(e.value) and "bias" in str(e.value)


def test_casts_and_moves_keep_the_scales_exact() -> None:
    torch.manual_seed(5)
    layer = nt.Linear4bit(64, 32, double_quant=True)
    x = torch.randn(2, 64)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    y = layer(x)
    layer.to(torch.bfloat16)
    layer.half()
    layer.float()
    layer.to("cpu")
    after = layer.state_dict()
    for key, value in before.items():
        if key != "bias":
            assert torch.equal(after[key], value), key
    assert layer.bias.dtype == torch.float32
    torch.testing.assert_close(layer(x), y, rtol=1e-3, atol=1e-3)  # the bias went through fp16


def test_compute_dtype_casts_activations_for_the_product() -> None:
    torch.manual_seed(6)
    layer = nt.Linear4bit(64, 32, bias=False, compute_dtype=torch.bfloat16)
    x = torch.randn(3, 64)
    y = layer(x)
    assert y.dtype == torch.float32
    want = (x.bfloat16().float() @ layer.dequantize(torch.float32).T).bfloat16().float()
    # float32 sums (the core's order, torch's order) rounded to bfloat16: one bf16 step apart
    # at most where a sum falls next to a rounding boundary
    torch.testing.assert_close(y, want, rtol=2**-7, atol=0)


def test_nf4_tensor_round_trip() -> None:
    q = nybble.quantize(np.random.default_rng(7).standard_normal((24, 64)).astype(np.float32))
    layer = nt.Linear4bit.from_nf4(q, bias=torch.zeros(24))
    back = layer.nf4_tensor()
    np.testing.assert_array_equal(back.codes, q.codes)
    np.testing.assert_array_equal(back.absmax, q.absmax)


# --- errors ----------------------------------------------------------------------------------


def test_a_non_nf4_state_is_refused_by_name() -> None:
    q = nybble.quantize(np.ones((48, 40), np.float32), codebook="fp4")
    state = torch_state(nybble.bnb.export_state(q))
    layer = nt.Linear4bit(40, 48, bias=False)
    with pytest.raises(FormatError) as e:
        layer.load_bnb_state(state)
    assert "holds NF4 weights; this state is fp4" in str(e.value)
    assert e.value.field == "weight.quant_state.bitsandbytes__fp4"
    with pytest.raises(RuntimeError, match="this state is fp4"):
        layer.load_state_dict(state)


def test_a_malformed_state_names_the_key() -> None:
    state = torch_state({k: v for k, v in fixture_state(0).items() if k.startswith("weight")})
    del state["weight.absmax"]
    with pytest.raises(FormatError) as e:
        nt.Linear4bit(40, 48, bias=False).load_bnb_state(state)
    assert e.value.field == "weight.absmax"
    wrong = torch_state({k: v for k, v in fixture_state(0).items() if k.startswith("weight")})
    with pytest.raises(ValueError, match=r"weight shape \[48, 40\] does not match the layer's"):
        nt.Linear4bit(40, 40, bias=False).load_bnb_state(wrong)


def test_bad_construction_and_inputs() -> None:
    with pytest.raises(ValueError, match="blocksize"):
        nt.Linear4bit(64, 32, blocksize=48)
    with pytest.raises(ValueError, match="must be positive"):
        nt.Linear4bit(0, 32)
    layer = nt.Linear4bit(64, 32)
    with pytest.raises(ValueError, match=r"weight must be a float tensor of shape \[32, 64\]"):
        layer.quantize_(torch.zeros(64, 32))
    with pytest.raises(ValueError, match="weight must be float32/float16/bfloat16/float64"):
        layer.quantize_(torch.zeros(32, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., 64\], got \[2, 63\]"):
        layer(torch.zeros(2, 63))
    with pytest.raises(ValueError, match="x must be float32/float16/bfloat16/float64, got int64"):
        layer(torch.zeros(2, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"expected a bitsandbytes\.nn\.Linear4bit"):
        nt.Linear4bit.from_bnb(torch.nn.Linear(2, 2))


# --- bitsandbytes itself, where it runs --------------------------------------------------------


def _bnb_layer(bnb: Any, device: str) -> Any:
    torch.manual_seed(8)
    layer = bnb.nn.Linear4bit(64, 48, bias=True, compute_dtype=torch.float32, quant_type="nf4")
    layer = layer.to(device)
    if getattr(layer.weight, "quant_state", None) is None:
        pytest.skip(f"bitsandbytes does not quantize on {device} here")
    return layer


def test_replace_bnb_is_bit_exact_with_bitsandbytes() -> None:
    bnb = pytest.importorskip("bitsandbytes")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        theirs = _bnb_layer(bnb, device)
    except Exception as e:  # bitsandbytes without a backend for this device
        pytest.skip(f"bitsandbytes cannot quantize on {device}: {e}")
    model = torch.nn.Sequential(theirs)
    x = torch.randn(4, 64, device=device)
    with torch.no_grad():
        want = model(x)
    deq = bnb.functional.dequantize_4bit(theirs.weight.data, theirs.weight.quant_state)
    nt.replace_bnb(model)
    ours = model[0]
    assert isinstance(ours, nt.Linear4bit) and ours.weight.device == theirs.weight.device
    assert torch.equal(ours.dequantize(deq.dtype), deq)
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=1e-4, atol=1e-4)
