"""nybble's codes and scales against bitsandbytes 0.50.2 on CUDA (golden fixtures made on an H100
by tests/fixtures/make_bnb_fixtures.py --device cuda; no GPU needed here).

bitsandbytes' CUDA quantizer differs from its CPU one, and from nybble, in documented ways
(docs/bitsandbytes.md, "Where nybble and bitsandbytes differ"): it normalises with an
approximate reciprocal (`rcp.approx`, up to 1 ulp off), four of its fifteen NF4 thresholds are
decimal literals 1 ulp off the f32 midpoints, and an all-zero block gets code 0 instead of 7. It
is built with --use_fast_math, so it also flushes subnormals to zero: subnormal inputs quantize
as 0, a block whose reciprocal 1/absmax is subnormal (absmax > 2^126) quantizes entirely as 0,
and products that would be subnormal dequantize to ±0. nybble's FP4 follows bitsandbytes' CUDA
tree with an exact reciprocal. So every code must either equal bitsandbytes' or be explained by
one of those rules: a zero block, a flushed subnormal, or a value within a few ulps of the
threshold between the two (adjacent) codes. Scales are equal everywhere, and nybble decodes
bitsandbytes' own codes to its dequantized values but for the flushed subnormals."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import nybble
from nybble import bnb, reference
from tests import FIXTURES

CUDA = np.load(FIXTURES / "bnb_cuda.npz")
CASES = sorted(
    k[:-2] for k in CUDA.files if k.endswith("/x") and f"{k[:-2]}/nf4/codes" in CUDA.files
)
#: Distance from a threshold, in ulps of the threshold, within which bitsandbytes' approximate
#: reciprocal (<= 1 ulp) and literal thresholds (1 ulp) can move a value across it.
NEAR_ULPS = 2
#: FP4 magnitude rank of each 3-bit code.
FP4_RANK = np.argsort(reference.FP4_MAGNITUDE_CODES)
SMALLEST_NORMAL = np.float32(2.0**-126)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def unpack_high_first(packed: np.ndarray, n: int) -> np.ndarray:
    return reference.unpack_nibbles(bnb.swap_nibbles(packed.ravel()), n)


def classify(x: np.ndarray, blocksize: int, codebook: str, theirs_packed: np.ndarray) -> dict:
    """Counts of nybble's codes that equal bitsandbytes-CUDA's, differ in an all-zero block,
    differ where bitsandbytes flushed a subnormal (input or reciprocal) to zero, differ next to
    a threshold, or differ for no documented reason."""
    x = x.astype(np.float32).ravel()
    n = x.size
    codes, absmax = reference.quantize(x, blocksize, codebook)
    ours = reference.unpack_nibbles(codes, n).astype(int)
    theirs = unpack_high_first(theirs_packed, n).astype(int)
    scale = np.repeat(absmax, blocksize)[:n]
    differ = ours != theirs
    zero = differ & (scale == 0)
    assert (theirs[scale == 0] == 0).all(), "bitsandbytes-CUDA writes code 0 in zero blocks"
    with np.errstate(divide="ignore"):
        flushed = (np.abs(x) < SMALLEST_NORMAL) | (np.float32(1) / scale < SMALLEST_NORMAL)
    code_of_zero = reference.encode(np.zeros(1, np.float32), codebook)[0]
    ftz = differ & (scale != 0) & flushed
    assert (theirs[ftz] == code_of_zero).all(), "a flushed value quantizes as 0"
    rest = differ & (scale != 0) & ~flushed
    with np.errstate(divide="ignore"):
        v = x[rest] * (np.float32(1) / scale[rest])
    if codebook == "nf4":
        lo, hi = np.minimum(ours[rest], theirs[rest]), np.maximum(ours[rest], theirs[rest])
        adjacent = hi == lo + 1
        threshold = reference.NF4_MIDPOINTS[np.minimum(lo, 14)]
        near = np.abs(v - threshold) <= NEAR_ULPS * np.abs(np.spacing(threshold))
    else:
        same_sign = (ours[rest] >> 3) == (theirs[rest] >> 3)
        r_ours, r_theirs = FP4_RANK[ours[rest] & 7], FP4_RANK[theirs[rest] & 7]
        lo = np.minimum(r_ours, r_theirs)
        adjacent = same_sign & (np.abs(r_ours - r_theirs) == 1)
        threshold = reference.FP4_THRESHOLDS[np.minimum(lo, 6)]
        near = np.abs(np.abs(v) - threshold) <= NEAR_ULPS * np.spacing(threshold)
    explained = adjacent & near
    return {
        "elements": n,
        "equal": int((~differ).sum()),
        "zero_block": int(zero.sum()),
        "flushed_subnormal": int(ftz.sum()),
        "near_threshold": int(explained.sum()),
        "unexplained": int((~explained).sum()),
    }


def test_fixture_was_made_by_bitsandbytes_0_50_2_on_cuda() -> None:
    assert str(CUDA["bitsandbytes_version"]) == "0.50.2"
    assert "normal_odd/fp4/codes" in CUDA.files  # FP4 is recorded only on CUDA
    np.testing.assert_array_equal(bits(reference.NF4), bits(CUDA["nf4_code"]))


@pytest.mark.parametrize("codebook", ["nf4", "fp4"])
@pytest.mark.parametrize("case", CASES)
def test_codes_equal_bitsandbytes_cuda_but_for_documented_differences(
    case: str, codebook: str
) -> None:
    x = CUDA[f"{case}/x"]
    bs = int(CUDA[f"{case}/blocksize"])
    q = nybble.quantize(x, blocksize=bs, codebook=codebook)
    np.testing.assert_array_equal(bits(q.absmax), bits(CUDA[f"{case}/{codebook}/absmax"]))
    counts = classify(x, bs, codebook, CUDA[f"{case}/{codebook}/codes"])
    print(case, codebook, counts)
    assert counts["unexplained"] == 0, counts
    if case.startswith("normal"):  # random data never lands within ulps of a threshold here
        assert counts["equal"] == counts["elements"], counts
    # nybble's fast path agrees with the oracle that `classify` used
    np.testing.assert_array_equal(q.codes, reference.quantize(x.ravel(), bs, codebook)[0])


def test_mismatches_are_few_and_where_expected() -> None:
    """The totals over every case: only the adversarial cases (exact and near ties, mixed
    scales with all-zero blocks) differ at all, and by a bounded amount."""
    total: dict[str, int] = {}
    for case in CASES:
        bs = int(CUDA[f"{case}/blocksize"])
        for codebook in ("nf4", "fp4"):
            counts = classify(CUDA[f"{case}/x"], bs, codebook, CUDA[f"{case}/{codebook}/codes"])
            for key, value in counts.items():
                total[key] = total.get(key, 0) + value
    print("bitsandbytes-CUDA vs nybble, all cases:", total)
    assert total["unexplained"] == 0
    zero_elements = sum(
        int((np.repeat(CUDA[f"{c}/nf4/absmax"], int(CUDA[f"{c}/blocksize"])) == 0).sum())
        for c in CASES
    )
    assert total["zero_block"] <= zero_elements  # NF4 only: FP4's zero code is 0 in both
    assert total["near_threshold"] <= 0.02 * total["elements"]


@pytest.mark.parametrize("codebook", ["nf4", "fp4"])
@pytest.mark.parametrize("case", ["normal_odd", "mixed_scales", "ties"])
def test_bitsandbytes_cuda_codes_decode_to_its_values(case: str, codebook: str) -> None:
    """nybble dequantizes bitsandbytes' own codes to its values, bit for bit, but where
    bitsandbytes flushed a subnormal product to ±0, and for FP4 the sign of zero
    (bitsandbytes-CUDA decodes code 8 as -0.0, nybble's table as +0.0)."""
    x = CUDA[f"{case}/x"]
    packed = CUDA[f"{case}/{codebook}/codes"]
    q = nybble.NF4Tensor(
        bnb.swap_nibbles(packed),
        CUDA[f"{case}/{codebook}/absmax"],
        (x.size,),
        int(CUDA[f"{case}/blocksize"]),
        codebook,
    )
    got = q.dequantize("float32")
    want = CUDA[f"{case}/{codebook}/dequantized"]
    flushed = (np.abs(got) < SMALLEST_NORMAL) & (got != 0) & (want == 0)
    print(case, codebook, "subnormal products flushed by bitsandbytes:", int(flushed.sum()))
    np.testing.assert_array_equal(got[~flushed], want[~flushed])
    differ = bits(got) != bits(want)
    signed_zero = differ & ~flushed
    if codebook == "nf4":
        assert not signed_zero.any()
    else:
        assert (unpack_high_first(packed, x.size)[signed_zero] == 8).all()
    if case != "mixed_scales":  # the only case with subnormal products
        assert not flushed.any()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_inputs(dtype: str) -> None:
    key = f"input_{dtype}"
    x = CUDA[f"{key}/bits"].view(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    q = nybble.quantize(x)
    np.testing.assert_array_equal(bits(q.absmax), bits(CUDA[f"{key}/absmax"]))
    counts = classify(x.astype(np.float32), 64, "nf4", CUDA[f"{key}/codes"])
    assert counts["equal"] == counts["elements"], counts
    theirs = nybble.NF4Tensor(
        bnb.swap_nibbles(CUDA[f"{key}/codes"]), CUDA[f"{key}/absmax"], x.shape
    )
    for out in ("float32", "bfloat16", "float16"):
        got = theirs.dequantize(out).astype(np.float32).ravel()
        np.testing.assert_array_equal(bits(got), bits(CUDA[f"{key}/dequantized_{out}"]))


def test_double_quant() -> None:
    """The offset is torch's CUDA mean (its own summation order): within 1 ulp of nybble's.
    With bitsandbytes' offset, the nested codes are those of the nearest dynamic-map value up
    to ties (CUDA breaks them to the even index) and its approximate reciprocal; its codes
    decode, through nybble, to exactly its dequantized weight."""
    x = CUDA["double/x"]
    q = nybble.quantize(x, double_quant=True)
    plain = CUDA["double/absmax_plain"]
    np.testing.assert_array_equal(bits(nybble.quantize(x).absmax), bits(plain))
    counts = classify(x, 64, "nf4", CUDA["double/codes"])
    assert counts["equal"] == counts["elements"], counts
    offset = CUDA["double/offset"]
    assert abs(float(q.nested.offset) - float(offset)) <= float(np.spacing(offset))
    codes, absmax2 = reference.quantize(plain - offset, 256, "dynamic8")
    np.testing.assert_array_equal(bits(absmax2), bits(CUDA["double/absmax2"]))
    theirs = CUDA["double/absmax_codes"]
    differ = codes != theirs
    print("nested codes differing from bitsandbytes-CUDA:", int(differ.sum()), "of", codes.size)
    assert differ.mean() <= 0.01
    assert np.abs(codes.astype(int) - theirs.astype(int)).max() <= 1
    decoded = reference.double_dequantize(theirs, CUDA["double/absmax2"], float(offset))
    state = nybble.NF4Tensor(bnb.swap_nibbles(CUDA["double/codes"]), decoded, x.shape)
    np.testing.assert_array_equal(
        bits(state.dequantize().ravel()), bits(CUDA["double/dequantized"])
    )


@pytest.mark.parametrize("dq", [0, 1])
def test_linear4bit_state_written_on_cuda(dq: int) -> None:
    prefix = f"state_dq{dq}/"
    state = {k[len(prefix) :]: CUDA[k] for k in CUDA.files if k.startswith(prefix)}
    q = bnb.import_state(state)
    assert q.shape == (48, 40) and q.double_quant == bool(dq) and q.orig_dtype == "bfloat16"
    want = state["dequantized_bf16_bits"].view(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bits(q.dequantize("bfloat16")), bits(want))
    w = state["w_bf16_bits"].view(ml_dtypes.bfloat16)
    ours = bnb.export_state(nybble.quantize(w, double_quant=bool(dq)))
    np.testing.assert_array_equal(ours["weight"], state["weight"])
