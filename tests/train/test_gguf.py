"""GGUF files: every block type nybble reads dequantizes bit for bit as llama.cpp's reference
(the `gguf` package's numpy port of ggml) does; other types and malformed files are refused by
name; llama.cpp's names and rotary row order map back to Hugging Face's; a small Llama written
as GGUF loads into the trainer with the losses of the model it came from."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from nybble.errors import FormatError
from nybble.models import gguf as G
from nybble.models import open_model
from nybble.train import Trainer
from tests.pretrained_fixtures import tiny_config

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

T = gguf.GGMLQuantizationType


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, object]], arch: str = "llama") -> None:
    """A GGUF file of the given (array, ggml type) tensors, written by the gguf package."""
    w = gguf.GGUFWriter(str(path), arch)
    for name, (a, kind) in tensors.items():
        if kind in (T.F32, T.F16):
            w.add_tensor(name, a.astype(np.float32 if kind == T.F32 else np.float16))
        else:
            q = quantize(a, kind)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_each_type_reads_as_the_reference(tmp_path: Path, kind: str) -> None:
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((6, 64)) * rng.uniform(0.01, 3, (6, 1))).astype(np.float32)
    a[2] = 0.0  # an all-zero block
    a[3, :5] = [1e-8, -1e-8, 7.0, -7.0, 0.5]
    path = tmp_path / "t.gguf"
    _write(path, {"w": (a, T[kind])})
    with G.GGUFFile(path) as f:
        got = f.read("w")
    reader = gguf.GGUFReader(str(path))
    want = dequantize(reader.tensors[0].data, reader.tensors[0].tensor_type)
    assert got.dtype == np.float32 and got.shape == (6, 64)
    np.testing.assert_array_equal(
        got.view(np.uint32), want.astype(np.float32).reshape(6, 64).view(np.uint32)
    )


def test_other_types_are_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("w", np.zeros((2, 144), np.uint8), raw_shape=(2, 144), raw_dtype=T.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(FormatError, match="stored as Q4_K; nybble reads F32, F16, Q4_0") as e:
        G.GGUFFile(path)
    assert e.value.field == "w"


def _valid(tmp_path: Path) -> bytes:
    path = tmp_path / "v.gguf"
    _write(
        path, {"a": (np.ones((2, 32), np.float32), T.Q8_0), "b": (np.ones(3, np.float32), T.F32)}
    )
    return path.read_bytes()


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda b: b"GGUX" + b[4:], "no GGUF magic"),
        (lambda b: b[:4] + struct.pack("<I", 9) + b[8:], "GGUF version 9"),
        (lambda b: b[:8] + struct.pack("<Q", 2**40) + b[16:], "tensors"),
        (lambda b: b[:40], "ends inside the header"),
        (lambda b: b[:-40], "beyond the end of the file"),
        (lambda b: b"", "ends inside the header"),
    ],
)
def test_malformed_files_are_format_errors(tmp_path: Path, edit: object, problem: str) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(edit(_valid(tmp_path)))  # type: ignore[operator]
    with pytest.raises(FormatError, match=problem):
        G.GGUFFile(path)


def test_every_truncation_and_byte_flip_of_the_header_is_handled(tmp_path: Path) -> None:
    """No cut or single-bit flip of the header ends in anything but a FormatError or a file
    that reads (a flip inside a name or a value can leave a valid file)."""
    raw = _valid(tmp_path)
    path = tmp_path / "x.gguf"
    header_end = raw.index(b"\x00" * 8, 24) if b"\x00" * 8 in raw[24:] else 200
    cases = [raw[:n] for n in range(0, min(len(raw), 400), 3)]
    rng = np.random.default_rng(0)
    for _ in range(300):
        b = bytearray(raw)
        i = int(rng.integers(0, min(len(raw), max(header_end, 64))))
        b[i] ^= 1 << int(rng.integers(0, 8))
        cases.append(bytes(b))
    for case in cases:
        path.write_bytes(case)
        try:
            with G.GGUFFile(path) as f:
                for name in f.tensors:
                    f.read(name)
        except FormatError:
            pass


def test_names_and_rotary_rows_map_back_to_hugging_face() -> None:
    assert G.hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert G.hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert G.hf_name("blk.1.attn_k.bias") == "model.layers.1.self_attn.k_proj.bias"
    assert G.hf_name("output.weight") == "lm_head.weight"
    assert G.hf_name("blk.x.attn_q.weight") is None and G.hf_name("rope_freqs.weight") is None
    # llama.cpp's converter permutes q/k rows so (i, i + half) pairs sit next to each other
    heads, dim = 3, 8
    w = np.arange(heads * dim * 5, dtype=np.float32).reshape(heads * dim, 5)
    permuted = w.reshape(heads, 2, dim // 2, 5).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(G.unpermute_rotary(permuted, heads), w)


def _llama_as_gguf(tmp_path: Path, kind: object) -> tuple[Trainer, Path]:
    """A tiny random Llama and its GGUF file, written as llama.cpp's converter writes one."""
    cfg = tiny_config(tie_word_embeddings=False)
    trainer = Trainer(cfg, None, seed=5)
    state = trainer.state_dict()
    by_hf = {}
    for name in state:
        for g, h in G._GLOBAL_NAMES.items():
            if h == name:
                by_hf[name] = g
        for i in range(cfg.num_hidden_layers):
            for g, h in G._LAYER_NAMES.items():
                for suffix in ("weight", "bias"):
                    if name == f"model.layers.{i}.{h}.{suffix}":
                        by_hf[name] = f"blk.{i}.{g}.{suffix}"
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(128)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for name, a in state.items():
        if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
            n = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        if a.ndim == 2 and kind != T.F32:
            q = quantize(a, kind)
            w.add_tensor(by_hf[name], q, raw_shape=q.shape, raw_dtype=kind)
        else:
            w.add_tensor(by_hf[name], a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return trainer, path


def test_a_llama_written_as_gguf_loads_with_its_losses(tmp_path: Path) -> None:
    trainer, path = _llama_as_gguf(tmp_path, T.F32)
    loaded = Trainer.from_pretrained(path, None, frozen=True)
    ids = np.random.default_rng(0).integers(0, 200, (2, 17))
    assert loaded.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(
        trainer.loss(ids[:, :-1], ids[:, 1:]), rel=1e-6
    )
    _, q8 = _llama_as_gguf(tmp_path, T.Q8_0)
    close = Trainer.from_pretrained(q8, None, frozen=True)
    assert close.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(
        trainer.loss(ids[:, :-1], ids[:, 1:]), rel=1e-2
    )
    with open_model(path) as files:
        assert files.config["num_key_value_heads"] == 2
        with pytest.raises(FormatError, match="tokenizer model None"):
            files.tokenizer()


def test_an_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(FormatError, match="architecture 'gemma2' is not supported") as e:
        open_model(path)
    assert e.value.field == "general.architecture"
