"""bitsandbytes 0.50.2 compatibility, against golden fixtures it produced
(tests/fixtures/make_bnb_fixtures.py) and, where torch + bitsandbytes are installed, live."""

from __future__ import annotations

import json
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import nybble
from nybble import bnb, reference
from nybble.errors import FormatError
from tests import FIXTURES

FIXTURES = FIXTURES
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


def _format_error(state: dict[str, Any]) -> FormatError:
    with pytest.raises(FormatError) as e:
        bnb.import_state(state)
    assert e.value.source == "bitsandbytes state"
    return e.value


def test_import_state_reports_what_is_wrong() -> None:
    good = bnb.export_state(nybble.quantize(np.ones((8, 8), np.float32)))
    blob = "weight.quant_state.bitsandbytes__nf4"
    e = _format_error({k: v for k, v in good.items() if k != "weight.absmax"})
    assert (e.field, e.problem) == ("weight.absmax", "missing")
    e = _format_error({k: v for k, v in good.items() if "quant_state" not in k})
    assert e.field == "weight.quant_state.bitsandbytes__*"
    assert _format_error(dict(good, weight=good["weight"][:-1])).field == "weight"
    bad = dict(good, **{blob: np.frombuffer(b"{not json", np.uint8)})
    assert _format_error(bad).field == blob
    assert _format_error(dict(good, **{"weight.quant_map": reference.FP4})).field == (
        "weight.quant_map"
    )
    with pytest.raises(ValueError, match="not int8"):
        bnb.export_state(nybble.quantize(np.ones(8, np.float32), codebook="int8"))


def _with_meta(state: dict[str, Any], **changes: Any) -> dict[str, Any]:
    key = next(k for k in state if "quant_state" in k)
    meta = json.loads(state[key].tobytes())
    meta.update(changes)
    for k, v in changes.items():
        if v is _DROP:
            del meta[k]
    return dict(state, **{key: np.frombuffer(json.dumps(meta).encode(), np.uint8)})


_DROP = object()


@pytest.mark.parametrize(
    "field, value",
    [
        ("blocksize", 48),
        ("blocksize", "64"),
        ("blocksize", 10**30),
        ("shape", "8x8"),
        ("shape", [8, -8]),
        ("shape", [2**40, 2**40]),
        ("dtype", "int8"),
        ("nested_offset", None),
        ("nested_offset", _DROP),
        ("nested_offset", "0.5"),
        ("nested_blocksize", 128),
    ],
)
def test_import_state_refuses_bad_metadata_naming_the_field(field: str, value: Any) -> None:
    good = bnb.export_state(nybble.quantize(np.ones((8, 8), np.float32), double_quant=True))
    e = _format_error(_with_meta(good, **{field: value}))
    assert e.field is not None and e.field.endswith(field)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_import_state_refuses_scales_that_cannot_be_right(bad: float) -> None:
    good = bnb.export_state(nybble.quantize(np.ones((8, 8), np.float32)))
    absmax = good["weight.absmax"].copy()
    absmax[0] = bad
    assert _format_error(dict(good, **{"weight.absmax": absmax})).field == "weight.absmax"
    dq = bnb.export_state(nybble.quantize(np.ones((8, 8), np.float32), double_quant=True))
    nested = dq["weight.nested_absmax"].copy()
    nested[0] = bad
    assert _format_error(dict(dq, **{"weight.nested_absmax": nested})).field == (
        "weight.nested_absmax"
    )


def test_import_state_refuses_uint8_scales_without_nested_metadata() -> None:
    dq = bnb.export_state(nybble.quantize(np.ones((8, 8), np.float32), double_quant=True))
    plain = {k: v for k, v in dq.items() if "nested" not in k}
    plain = _with_meta(plain, nested_offset=_DROP, nested_blocksize=_DROP, nested_dtype=_DROP)
    assert _format_error(plain).field == "weight.absmax"


def test_import_state_refuses_odd_keys_and_containers() -> None:
    good = bnb.export_state(nybble.quantize(np.ones((8, 8), np.float32)))
    state: dict[Any, Any] = dict(good)
    state[3] = np.zeros(1)  # a non-string key is not ours to read, and not an error
    assert bnb.import_state(state).shape == (8, 8)
    with pytest.raises(FormatError):
        bnb.import_state([("weight", good["weight"])])  # type: ignore[arg-type]
    assert _format_error(dict(good, weight=[[1, 2]])).field == "weight"


def test_quantize_4bit_takes_bitsandbytes_names() -> None:
    x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    q = bnb.quantize_4bit(x, compress_statistics=True, quant_type="nf4")
    assert (q.codebook, q.double_quant) == ("nf4", True)
    assert bnb.quantize_4bit(x).codebook == "fp4"  # bitsandbytes' default
    with pytest.raises(ValueError, match="quant_type"):
        bnb.quantize_4bit(x, quant_type="int8")


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
