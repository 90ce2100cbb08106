"""nybble's safetensors reading and writing: exactly the files the `safetensors` library
accepts, every dtype it knows, no memory map (a file truncated while open is a FormatError,
never a SIGBUS), atomic writes, and the streaming writer the checkpoint tools use."""

from __future__ import annotations

import json
import os
import signal
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy

from nybble import safetensors_io as st
from nybble.errors import FormatError

TENSORS = {
    "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
    "f16": np.linspace(-1, 1, 5).astype(np.float16),
    "bf16": np.linspace(-2, 2, 7).astype(ml_dtypes.bfloat16),
    "f64": np.array(3.5, np.float64),
    "i64": np.array([[-1, 2]], np.int64),
    "u32": np.array([1, 2**32 - 1], np.uint32),
    "u16": np.arange(3, dtype=np.uint16),
    "u8": np.arange(3, dtype=np.uint8),
    "i8": np.array([-128, 127], np.int8),
    "bool": np.array([True, False]),
    "f8_e4m3": np.array([0.5, -448.0], ml_dtypes.float8_e4m3fn),
    "f8_e5m2": np.array([1.5, -2.0], ml_dtypes.float8_e5m2),
    "c64": np.array([1 + 2j], np.complex64),
    "empty": np.zeros((0, 3), np.float32),
}


def _header(path: Path) -> tuple[int, dict[str, object], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n]), raw


def test_round_trip_of_every_dtype_with_metadata(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    st.save(TENSORS, path, metadata={"format": "pt", "n": 3})
    with st.SafeTensorsFile(path) as f:
        assert f.metadata == {"format": "pt", "n": "3"}
        assert set(f.keys()) == set(TENSORS)
        assert f.dtype_name("bf16") == "BF16" and f.dtype_name("f8_e4m3") == "F8_E4M3"
        assert f.shape("f32") == (3, 4) and f.shape("f64") == ()
        for k, v in TENSORS.items():
            got = f.get(k)
            assert got.dtype == v.dtype and got.shape == v.shape
            assert got.tobytes() == v.tobytes()
            assert got.flags.writeable
            assert f.raw(k).tobytes() == v.tobytes()
    assert dict(st.iter_tensors(path)).keys() == TENSORS.keys()
    assert not list(tmp_path.glob(".*tmp"))  # the temporary was renamed away


def test_the_library_and_nybble_read_each_others_files(tmp_path: Path) -> None:
    ours = tmp_path / "ours.safetensors"
    st.save(TENSORS, ours, metadata={"a": "b"})
    loaded = safetensors.deserialize(ours.read_bytes())
    assert {k: bytes(v["data"]) for k, v in loaded} == {k: v.tobytes() for k, v in TENSORS.items()}
    plain = {k: v for k, v in TENSORS.items() if not k.startswith("f8")}
    theirs = tmp_path / "theirs.safetensors"
    safetensors.numpy.save_file(plain, str(theirs), metadata={"a": "b"})
    got = st.load(theirs)
    for k, v in plain.items():
        assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes()


def test_u32_and_f8_tensors_do_not_make_a_file_unreadable(tmp_path: Path) -> None:
    """Issue 16's reproducer: a valid file with U32 and F8_E4M3 tensors reads."""
    path = tmp_path / "t.safetensors"
    safetensors.numpy.save_file(
        {"u": np.arange(4, dtype=np.uint32), "w": np.ones(3, np.float32)}, str(path)
    )
    assert st.load(path)["u"].tolist() == [0, 1, 2, 3]
    st.save({"e": np.array([1.0, 2.0], ml_dtypes.float8_e4m3fn)}, path)
    assert st.load(path)["e"].astype(np.float32).tolist() == [1.0, 2.0]


def test_a_packed_f4_tensor_opens_and_reads_as_bytes(tmp_path: Path) -> None:
    path = tmp_path / "f4.safetensors"
    header = json.dumps({"p": {"dtype": "F4", "shape": [2, 4], "data_offsets": [0, 4]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x12\x34\x56\x78")
    with st.SafeTensorsFile(path) as f:
        assert f.shape("p") == (2, 4) and f.nbytes("p") == 4
        assert f.raw("p").tobytes() == b"\x12\x34\x56\x78"
        with pytest.raises(FormatError) as e:
            f.get("p")
        assert e.value.field == "p" and e.value.source == str(path)


def _files_the_library_rejects(valid: bytes) -> dict[str, bytes]:
    (n,) = struct.unpack("<Q", valid[:8])
    header = json.loads(valid[8 : 8 + n])
    data = valid[8 + n :]

    def rebuild(h: dict[str, object], body: bytes = data) -> bytes:
        raw = json.dumps(h).encode()
        return struct.pack("<Q", len(raw)) + raw + body

    overlap = json.loads(json.dumps(header))
    names = [k for k in overlap if k != "__metadata__"]
    overlap[names[1]]["data_offsets"] = overlap[names[0]]["data_offsets"]
    shape = json.loads(json.dumps(header))
    shape[names[0]]["shape"] = [7]
    dtype = json.loads(json.dumps(header))
    dtype[names[0]]["dtype"] = "XYZ"
    return {
        "4 bytes inserted after the header": valid[: 8 + n] + b"\0\0\0\0" + data,
        "overlapping offsets": rebuild(overlap),
        "shape disagrees with offsets": rebuild(shape),
        "unknown dtype": rebuild(dtype),
        "truncated": valid[:-3],
        "header length beyond the file": struct.pack("<Q", len(valid)) + valid[8:],
        "too short": valid[:5],
        "not JSON": struct.pack("<Q", 5) + b"{nope",
        "a JSON list": struct.pack("<Q", 2) + b"[]",
        "metadata not strings": rebuild({"__metadata__": {"a": 1}}, b""),
    }


def test_files_the_library_rejects_are_format_errors(tmp_path: Path) -> None:
    valid = safetensors.numpy.save({"a": np.arange(4, dtype=np.float32), "b": np.ones(2, np.int64)})
    path = tmp_path / "bad.safetensors"
    for case, raw in _files_the_library_rejects(valid).items():
        with pytest.raises(safetensors.SafetensorError):
            safetensors.deserialize(raw)
        path.write_bytes(raw)
        with pytest.raises(FormatError) as e:
            st.load(path)
        assert e.value.source == str(path), case


def test_a_file_truncated_while_open_is_a_format_error_not_a_crash(tmp_path: Path) -> None:
    """Run in a child process: a SIGBUS (what a memory map gives) would kill it."""
    path = tmp_path / "t.safetensors"
    st.save({"a": np.arange(1 << 16, dtype=np.float32), "b": np.ones(8, np.float32)}, path)
    code = f"""
import os
from nybble import safetensors_io as st
from nybble.errors import FormatError
f = st.SafeTensorsFile({str(path)!r})
os.truncate({str(path)!r}, 200)
try:
    f.get("a")
except FormatError as e:
    print("FormatError", e.field)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["FormatError", "a"]


def test_non_regular_files_are_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(FormatError) as e:
        st.SafeTensorsFile(fifo)
    assert e.value.problem == "not a regular file"
    with pytest.raises(FormatError):
        st.SafeTensorsFile(tmp_path)


def test_save_keeps_the_umask_mode_and_leaves_nothing_on_failure(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    old = os.umask(0o027)
    try:
        st.save({"a": np.ones(2, np.float32)}, path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    with pytest.raises(ValueError, match="cannot be stored"):
        st.save({"o": np.array(["x"], object)}, tmp_path / "o.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.safetensors"]


def test_big_endian_arrays_are_stored_as_their_values(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    values = np.array([0.5, -3.25, 1e3])
    st.save({"f": values.astype(">f4"), "h": values.astype(">f2")}, path)
    got = st.load(path)
    assert got["f"].tolist() == [0.5, -3.25, 1000.0] and got["h"].tolist() == [0.5, -3.25, 1000.0]


def test_stream_writer_writes_in_any_order_and_the_library_reads_it(tmp_path: Path) -> None:
    target = tmp_path / "s.safetensors"
    tensors = {
        "blob": np.frombuffer(b'{"x": 1.5}', np.uint8),
        "u8": np.arange(5, dtype=np.uint8),
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "bf16": np.ones(3, ml_dtypes.bfloat16),
        "scalar": np.array(2.0, np.float32),
    }
    entries = [
        st.Entry("blob", "U8", (64,), max_bytes=64),
        st.Entry("u8", "U8", (5,)),
        st.Entry("f32", "F32", (2, 3)),
        st.Entry("bf16", "BF16", (3,)),
        st.Entry("scalar", "F32", ()),
    ]
    w = st.StreamWriter(target, entries, {"format": "pt"})
    for name in ("scalar", "blob", "bf16", "f32"):
        w.write(name, tensors[name])
    w.write("u8", tensors["u8"].copy(), raw=True)
    assert w.pending == set()
    path = w.finish()
    os.replace(path, target)
    loaded = dict(safetensors.deserialize(target.read_bytes()))
    assert {k: bytes(v["data"]) for k, v in loaded.items()} == {
        k: v.tobytes() for k, v in tensors.items()
    }
    n, header, _ = _header(target)
    assert n % 8 == 0 and header["blob"]["shape"] == [10]  # type: ignore[index]
    with st.SafeTensorsFile(target) as f:
        assert f.metadata == {"format": "pt"}
        # fixed tensors by decreasing alignment, variable ones last: every offset aligned
        for k in f.keys():
            assert (f.info(k).offset - 8 - n) % max(1, f.get(k).dtype.itemsize) == 0


def test_stream_writer_refuses_misuse_and_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "s.safetensors"
    w = st.StreamWriter(target, [st.Entry("a", "F32", (2,)), st.Entry("b", "U8", (4,), 4)])
    with pytest.raises(ValueError):
        w.write("a", np.ones(3, np.float32))  # wrong shape
    with pytest.raises(ValueError):
        w.write("a", np.ones(2, np.float64))  # wrong dtype
    with pytest.raises(ValueError):
        w.write("b", np.ones(5, np.uint8))  # longer than planned
    with pytest.raises(ValueError):
        w.write("c", np.ones(2, np.float32))  # not planned
    w.write("a", np.ones(2, np.float32))
    with pytest.raises(ValueError):
        w.write("a", np.ones(2, np.float32))  # twice
    with pytest.raises(ValueError, match="not written"):
        w.finish()
    w.abort()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError):
        st.StreamWriter(target, [st.Entry("a", "F32", (2,)), st.Entry("a", "F32", (2,))])
    with st.StreamWriter(target, [st.Entry("a", "F32", (2,))]) as w2:
        assert w2.temporary.exists()
    with pytest.raises(RuntimeError), st.StreamWriter(target, [st.Entry("a", "F32", (2,))]):
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


# --- the library's own temporaries -----------------------------------------------------------


def _writers(folder: Path) -> dict[str, Callable[[], None]]:
    """The writers that hand arrays to the library's serializer: `save`, and adapter saves
    (new directory, and over an existing adapter)."""
    from nybble import LoraAdapter, LoraConfig

    adapter = LoraAdapter(LoraConfig(r=2, alpha=4, target_modules=("q_proj",)))
    adapter.add_layer("model.q_proj", np.ones((4, 6), np.float32))
    return {
        "save": lambda: st.save({"a": np.ones(3, np.float32)}, folder / "t.safetensors"),
        "adapter": lambda: adapter.save_pretrained(folder / "adapter"),
    }


def _killed_inside_the_library(writer: str, folder: Path) -> None:
    """Runs `writer` in a forked child whose serializer makes its temporary as the library
    does (`.tmpXXXXXX` beside the path it is given) and is then SIGKILLed."""
    pid = os.fork()
    if pid == 0:  # the child
        try:

            def killed(specs: Any, path: Any, metadata: Any = None) -> None:
                (Path(path).parent / ".tmpAbC123").write_bytes(b"partial")
                os.kill(os.getpid(), signal.SIGKILL)

            safetensors.serialize_file = killed  # type: ignore[assignment]
            _writers(folder)[writer]()
        finally:
            os._exit(3)  # not reached when killed
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _everything_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("writer", ["save", "adapter"])
def test_the_librarys_temporaries_of_a_killed_write_are_swept(tmp_path: Path, writer: str) -> None:
    """A kill inside the library's serializer leaves its `.tmpXXXXXX` only inside a directory
    named as nybble's temporaries, which the next write beside the target sweeps; files that
    are not certainly nybble's (another program's `.tmp` file) are left alone."""
    (tmp_path / ".tmpForeign").write_bytes(b"not ours")
    _writers(tmp_path)[writer]()  # a complete write first (the adapter: over an existing one)
    complete = _everything_under(tmp_path)
    for _ in range(3):
        _killed_inside_the_library(writer, tmp_path)
    left = _everything_under(tmp_path) - complete
    assert left and not any(Path(p).parent == Path(".") and "tmpAbC" in p for p in left), left
    _writers(tmp_path)[writer]()
    assert _everything_under(tmp_path) == complete
    assert (tmp_path / ".tmpForeign").read_bytes() == b"not ours"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_real_kill_while_the_library_writes_leaves_nothing_after_the_next_save(
    tmp_path: Path,
) -> None:
    """The same with the real serializer: a child saves a large tensor again and again and is
    killed once the library's temporary exists; the next save leaves only its file."""
    path = tmp_path / "big.safetensors"
    big = {"a": np.ones(16 * 2**20, np.float32)}
    seen = 0
    for _ in range(20):
        pid = os.fork()
        if pid == 0:
            try:
                while True:
                    st.save(big, path)
            finally:
                os._exit(3)
        deadline = time.monotonic() + 30
        while not any(p.name.startswith(".tmp") for p in tmp_path.rglob("*")):
            assert time.monotonic() < deadline, "the writer never made a temporary"
            time.sleep(0.0005)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        seen += any(p.name.startswith(".tmp") for p in tmp_path.rglob("*"))
        st.save({"a": np.ones(2, np.float32)}, path)
        assert _everything_under(tmp_path) == {"big.safetensors"}
        if seen >= 3:
            break
    assert seen >= 3, "no kill landed while the library's temporary existed"
