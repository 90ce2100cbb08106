"""bitsandbytes 0.50.2 compatibility, against golden fixtures it produced
(tests/fixtures/make_bnb_fixtures.py) and, where torch + bitsandbytes are installed, live."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import nybble
from nybble import bnb, reference
from nybble.errors import FormatError

FIXTURES = Path(__file__).parent / "fixtures"
CPU = np.load(FIXTURES / "bnb_cpu.npz")
CASES = sorted({k.split("/")[0] for k in CPU.files if k.endswith("/x") and "/nf4" not in k})
CASES = [c for c in CASES if f"{c}/nf4/codes" in CPU.files]


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def test_fixture_was_made_by_bitsandbytes_0_50_2() -> None:
    assert str(CPU["bitsandbytes_version"]) == "0.50.2"


def test_codebooks_equal_bitsandbytes_tables() -> None:
    np.testing.assert_array_equal(bits(reference.NF4), bits(CPU["nf4_code"]))
    np.testing.assert_array_equal(bits(reference.FP4), bits(CPU["fp4_code"]))
    np.testing.assert_array_equal(bits(reference.DYNAMIC_MAP), bits(CPU["dynamic_map"]))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("impl", ["reference", "rust"])
def test_codes_and_absmax_equal_bitsandbytes(case: str, impl: str) -> None:
    x = CPU[f"{case}/x"]
    bs = int(CPU[f"{case}/blocksize"])
    if impl == "reference":
        codes, absmax = reference.quantize(x.ravel(), bs)
    else:
        q = nybble.quantize(x, blocksize=bs)
        codes, absmax = q.codes, q.absmax
    np.testing.assert_array_equal(bits(absmax), bits(CPU[f"{case}/nf4/absmax"]))
    np.testing.assert_array_equal(bnb.swap_nibbles(codes), CPU[f"{case}/nf4/codes"])
    if f"{case}/nf4/dequantized" in CPU.files:
        deq = nybble.quantize(x, blocksize=bs).dequantize("float32").ravel()
        np.testing.assert_array_equal(bits(deq), bits(CPU[f"{case}/nf4/dequantized"]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_inputs_and_outputs_equal_bitsandbytes(dtype: str) -> None:
    key = f"input_{dtype}"
    x = CPU[f"{key}/bits"].view(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    q = nybble.quantize(x)
    np.testing.assert_array_equal(bits(q.absmax), bits(CPU[f"{key}/absmax"]))
    np.testing.assert_array_equal(bnb.swap_nibbles(q.codes), CPU[f"{key}/codes"])
    for out in ("float32", "bfloat16", "float16"):
        got = q.dequantize(out).astype(np.float32).ravel()
        np.testing.assert_array_equal(bits(got), bits(CPU[f"{key}/dequantized_{out}"]))


def test_double_quant_equals_bitsandbytes_within_the_rounding_of_the_mean() -> None:
    """The offset is a float32 mean, whose rounding depends on the summation order; with the
    same offset, the nested codes are those of the nearest dynamic-map value. bitsandbytes'
    CPU search is not always exactly nearest, so a few codes may sit one step away."""
    plain = CPU["double/absmax_plain"]
    q = nybble.quantize(CPU["double/x"], double_quant=True)
    np.testing.assert_array_equal(q.codes, bnb.swap_nibbles(CPU["double/codes"]))
    offset = CPU["double/offset"]
    assert abs(float(q.nested.offset) - float(offset)) <= float(np.spacing(offset))
    codes, absmax2 = reference.quantize(plain - offset, 256, "dynamic8")
    np.testing.assert_array_equal(bits(absmax2), bits(CPU["double/absmax2"]))
    theirs = CPU["double/absmax_codes"]
    assert np.mean(codes == theirs) >= 0.99
    assert np.abs(codes.astype(int) - theirs.astype(int)).max() <= 1
    # Decoded scales: bitsandbytes' map and formula give its dequantized weight exactly.
    decoded = reference.double_dequantize(theirs, CPU["double/absmax2"], float(offset))
    state = nybble.NF4Tensor(q.codes, decoded, q.shape)
    np.testing.assert_array_equal(bits(state.dequantize().ravel()), bits(CPU["double/dequantized"]))


@pytest.mark.parametrize("dq", [0, 1])
def test_import_state_written_by_bitsandbytes(dq: int) -> None:
    prefix = f"state_dq{dq}/"
    state = {k[len(prefix) :]: CPU[k] for k in CPU.files if k.startswith(prefix)}
    q = bnb.import_state(state)
    assert q.shape == (48, 40) and q.double_quant == bool(dq) and q.orig_dtype == "bfloat16"
    want = state["dequantized_bf16_bits"].view(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bits(q.dequantize("bfloat16")), bits(want))


@pytest.mark.parametrize("dq", [0, 1])
def test_export_state_matches_what_bitsandbytes_writes(dq: int) -> None:
    prefix = f"state_dq{dq}/"
    theirs = {k[len(prefix) :]: CPU[k] for k in CPU.files if k.startswith(prefix)}
    w = theirs["w_bf16_bits"].view(ml_dtypes.bfloat16)
    ours = bnb.export_state(nybble.quantize(w, double_quant=bool(dq)))
    expected_keys = {k for k in theirs if k.startswith("weight")}
    assert set(ours) == expected_keys
    for key in expected_keys:
        assert ours[key].dtype == theirs[key].dtype, key
        assert ours[key].shape == theirs[key].shape, key
    meta = json.loads(ours["weight.quant_state.bitsandbytes__nf4"].tobytes())
    their_meta = json.loads(theirs["weight.quant_state.bitsandbytes__nf4"].tobytes())
    assert list(meta) == list(their_meta)
    assert {k: v for k, v in meta.items() if k != "nested_offset"} == {
        k: v for k, v in their_meta.items() if k != "nested_offset"
    }
    np.testing.assert_array_equal(ours["weight"], theirs["weight"])
    for key in ("weight.quant_map", "weight.nested_quant_map"):
        if key in theirs:
            np.testing.assert_array_equal(bits(ours[key]), bits(theirs[key]))
    if not dq:
        np.testing.assert_array_equal(bits(ours["weight.absmax"]), bits(theirs["weight.absmax"]))
        assert (
            ours["weight.quant_state.bitsandbytes__nf4"].tobytes()
            == theirs["weight.quant_state.bitsandbytes__nf4"].tobytes()
        )


@pytest.mark.parametrize("codebook", ["nf4", "fp4"])
@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("shape", [(7,), (33, 65), (300, 64)])
def test_export_import_round_trip(codebook: str, dq: bool, shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    q = nybble.quantize(x, double_quant=dq, codebook=codebook)
    back = bnb.import_state(
        bnb.export_state(q, prefix="model.layers.0.mlp.up_proj.weight"),
        prefix="model.layers.0.mlp.up_proj.weight",
    )
    assert back.shape == q.shape and back.codebook == codebook and back.double_quant == dq
    np.testing.assert_array_equal(back.codes, q.codes)
    np.testing.assert_array_equal(bits(back.dequantize()), bits(q.dequantize()))


def test_import_state_reports_what_is_wrong() -> None:
    good = bnb.export_state(nybble.quantize(np.ones((8, 8), np.float32)))
    with pytest.raises(FormatError, match=r"missing key 'weight\.absmax'"):
        bnb.import_state({k: v for k, v in good.items() if k != "weight.absmax"})
    with pytest.raises(FormatError, match="quant_state"):
        bnb.import_state({k: v for k, v in good.items() if "quant_state" not in k})
    bad = dict(good, **{"weight": good["weight"][:-1]})
    with pytest.raises(FormatError, match="bytes, shape"):
        bnb.import_state(bad)
    bad = dict(
        good, **{"weight.quant_state.bitsandbytes__nf4": np.frombuffer(b"{not json", np.uint8)}
    )
    with pytest.raises(FormatError, match="unreadable"):
        bnb.import_state(bad)
    bad = dict(good, **{"weight.quant_map": reference.FP4})
    with pytest.raises(FormatError, match="not the standard nf4 codebook"):
        bnb.import_state(bad)
    with pytest.raises(ValueError, match="not int8"):
        bnb.export_state(nybble.quantize(np.ones(8, np.float32), codebook="int8"))


# --- live comparison where torch + bitsandbytes are installed ---------------------------


def _bitsandbytes() -> tuple[Any, Any]:
    return pytest.importorskip("bitsandbytes"), pytest.importorskip("torch")


@pytest.mark.parametrize("seed", range(5))
def test_live_bitsandbytes_cpu_codes_equal(seed: int) -> None:
    _, torch = _bitsandbytes()
    import bitsandbytes.functional as F

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 20000))
    bs = int(rng.choice([32, 64, 128, 256, 1024, 4096]))
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-20, 20)).astype(np.float32)
    packed, state = F.quantize_4bit(torch.from_numpy(x), blocksize=bs, quant_type="nf4")
    q = nybble.quantize(x, blocksize=bs)
    np.testing.assert_array_equal(bits(q.absmax), bits(state.absmax.numpy()))
    np.testing.assert_array_equal(bnb.swap_nibbles(q.codes), packed.numpy().ravel())
    np.testing.assert_array_equal(
        bits(q.dequantize()), bits(F.dequantize_4bit(packed, state).numpy().ravel())
    )
