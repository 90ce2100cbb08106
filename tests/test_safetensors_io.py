"""nybble's safetensors reader/writer: the format as the reference implementation reads it."""

from __future__ import annotations

import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from nybble import safetensors_io as st
from nybble.errors import FormatError

TENSORS = {
    "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
    "f16": np.linspace(-1, 1, 5).astype(np.float16),
    "bf16": np.linspace(-2, 2, 7).astype(ml_dtypes.bfloat16),
    "i64": np.array([[-1, 2]], np.int64),
    "u8": np.arange(3, dtype=np.uint8),
    "empty": np.zeros((0, 3), np.float32),
    "scalar": np.array(3.5, np.float64),
}


def test_round_trip_with_metadata(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    st.save(TENSORS, path, metadata={"format": "pt"})
    with st.SafeTensorsFile(path) as f:
        assert f.metadata == {"format": "pt"} and f.keys() == list(TENSORS)
        assert f.dtype_name("bf16") == "BF16" and f.shape("f32") == (3, 4)
        for k, v in TENSORS.items():
            got = f.get(k)
            assert got.dtype == v.dtype and got.shape == v.shape
            assert got.tobytes() == v.tobytes()
    assert [k for k, _ in st.iter_tensors(path)] == list(TENSORS)
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was renamed away


def test_the_reference_implementation_reads_our_files(tmp_path: Path) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "t.safetensors"
    plain = {k: v for k, v in TENSORS.items() if k != "bf16"}  # numpy API has no bf16
    st.save(plain, path)
    loaded = safetensors_numpy.load_file(str(path))
    for k, v in plain.items():
        np.testing.assert_array_equal(loaded[k], v)
    other = tmp_path / "other.safetensors"
    safetensors_numpy.save_file(plain, str(other), metadata={"a": "b"})
    got = st.load(other)
    for k, v in plain.items():
        np.testing.assert_array_equal(got[k], v)


def test_malformed_files_raise_format_errors(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    cases = [
        b"\x01\x02",
        struct.pack("<Q", 1000) + b"{}",
        struct.pack("<Q", 2) + b"[]",
        struct.pack("<Q", 5) + b"{nope",
        struct.pack("<Q", 56) + b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}}    ',
        struct.pack("<Q", 57)
        + b'{"a":{"dtype":"XYZ","shape":[1],"data_offsets":[0,4]}}    '
        + b"\0" * 4,
    ]
    for raw in cases:
        path.write_bytes(raw)
        with pytest.raises(FormatError):
            st.load(path)
    with pytest.raises(ValueError, match="cannot be stored"):
        st.save({"c": np.zeros(2, np.complex64)}, tmp_path / "c.safetensors")
