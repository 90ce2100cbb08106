"""Hypothesis strategies for codec inputs: lengths that hit block and SIMD edges, values
that hit the quantization rules (exact midpoints, signed zeros, subnormals, tiny and huge
blocks)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from nybble import reference

EDGE_LENGTHS = [0, 1, 2, 7, 8, 15, 16, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000]
BLOCKSIZES = [32, 64, 128, 256, 512, 1024, 2048, 4096]

lengths = st.one_of(st.sampled_from(EDGE_LENGTHS), st.integers(0, 5000))
blocksizes = st.sampled_from(BLOCKSIZES)

_midpoints = [float(m) for m in reference.NF4_MIDPOINTS] + [
    float(t) for t in reference.FP4_THRESHOLDS
]
_specials = [0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1.1754944e-38, 2.0**-140, 3.0e38, -3.0e38]

unit_values = st.one_of(
    st.floats(-1.0, 1.0, width=32),
    st.sampled_from(_midpoints).flatmap(lambda m: st.sampled_from([m, -m])),
    st.sampled_from(_specials),
)
#: Per-block scales: powers of two keep midpoints exact after normalisation.
scales = st.one_of(
    st.sampled_from([1.0, 2.0**-140, 2.0**-126, 2.0**-20, 2.0**20, 2.0**100, 0.0]),
    st.floats(2.0**-100, 2.0**100, width=32),
)


@st.composite
def float32_arrays(draw: st.DrawFn, n: int | None = None, blocksize: int = 64) -> np.ndarray:
    """A flat float32 array whose blocks have varied scales and adversarial values."""
    size = draw(lengths) if n is None else n
    unit = draw(hnp.arrays(np.float32, size, elements=unit_values))
    nblocks = -(-size // blocksize)
    block_scale = draw(hnp.arrays(np.float32, nblocks, elements=scales))
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        x = unit * np.repeat(block_scale, blocksize)[:size]
    x[~np.isfinite(x)] = 0.0
    return x.astype(np.float32)
