"""GGUF files (llama.cpp's format): the metadata, the tensors dequantized to float32 exactly
as llama.cpp does, and the map from llama.cpp's tensor names to Hugging Face's.

The format (little-endian): "GGUF", version (3; 2 reads the same), tensor count and
metadata count (u64); the metadata as (key string, value type u32, value); per tensor its
name, dims (u32 count, u64 each, fastest first), ggml type (u32) and data offset (u64); then,
at the next multiple of `general.alignment` (32), the tensor data. A string is a u64 length
and UTF-8 bytes. Only the block types below are read; any other is refused by name.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np

from ..errors import FormatError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
#: Limits that keep a malformed header from asking for unbounded memory or time.
MAX_STRING_BYTES = 1 << 24
MAX_ARRAY_ITEMS = 1 << 24
MAX_TENSORS = 1 << 20
MAX_METADATA = 1 << 16
MAX_DIMS = 4

# Metadata value types
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "uint8"),
    1: ("<b", "int8"),
    2: ("<H", "uint16"),
    3: ("<h", "int16"),
    4: ("<I", "uint32"),
    5: ("<i", "int32"),
    6: ("<f", "float32"),
    7: ("<?", "bool"),
    10: ("<Q", "uint64"),
    11: ("<q", "int64"),
    12: ("<d", "float64"),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class BlockType:
    """A ggml tensor type: elements per block, bytes per block, and its dequantizer (bytes of
    n blocks [n, nbytes] -> float32 [n, block])."""

    name: str
    block: int
    nbytes: int
    dequantize: Callable[[np.ndarray], np.ndarray]


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The f16 at byte `at` of each block, widened to float32 [n, 1]."""
    return blocks[:, at : at + 2].copy().view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's order: the 16 low nibbles of a block's bytes, then the 16 high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    # y = d * q: one f32 product per element (dequantize_row_q8_0)
    return _half(blocks, 0) * blocks[:, 2:34].view(np.int8).astype(np.float32)


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    # y = (q - 8) * d (dequantize_row_q4_0)
    q = _nibbles(blocks[:, 2:18]).astype(np.int8) - np.int8(8)
    return q.astype(np.float32) * _half(blocks, 0)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    # y = q * d + m, the product rounded to f32 before the sum (dequantize_row_q4_1)
    q = _nibbles(blocks[:, 4:20]).astype(np.float32)
    return q * _half(blocks, 0) + _half(blocks, 2)


def _plain(dtype: Any) -> Callable[[np.ndarray], np.ndarray]:
    def widen(blocks: np.ndarray) -> np.ndarray:
        return blocks.copy().view(dtype).astype(np.float32)

    return widen


#: The ggml types nybble reads, by type number.
BLOCK_TYPES: dict[int, BlockType] = {
    0: BlockType("F32", 1, 4, _plain("<f4")),
    1: BlockType("F16", 1, 2, _plain("<f2")),
    2: BlockType("Q4_0", 32, 18, _q4_0),
    3: BlockType("Q4_1", 32, 20, _q4_1),
    8: BlockType("Q8_0", 32, 34, _q8_0),
    30: BlockType("BF16", 1, 2, _plain(ml_dtypes.bfloat16)),
}
#: Names of the ggml types nybble does not read, for the error that refuses them.
OTHER_TYPES = {
    6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K",
    14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
    20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip


@dataclass(frozen=True)
class TensorEntry:
    name: str
    #: numpy order (slowest first): GGUF's dims reversed
    shape: tuple[int, ...]
    kind: BlockType
    offset: int  # from the start of the file

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size // self.kind.block * self.kind.nbytes


class GGUFFile:
    """A GGUF file opened for reading: `metadata` (key -> value; arrays as lists),
    `tensors` (name -> TensorEntry) and `read(name)` (float32, one tensor at a time).
    FormatError naming the file and the field for anything malformed."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._file: BinaryIO = open(self.path, "rb")
        except OSError as e:
            raise FormatError(self.path, f"cannot be opened ({e.strerror or e})") from None
        try:
            self.size = os.fstat(self._file.fileno()).st_size
            self.metadata: dict[str, Any] = {}
            self.tensors: dict[str, TensorEntry] = {}
            self._parse()
        except BaseException:
            self._file.close()
            raise

    def fail(self, problem: str, field: str | None = None) -> FormatError:
        return FormatError(self.path, problem, field)

    # --- the header ---------------------------------------------------------------------------

    def _take(self, n: int, what: str) -> bytes:
        data = self._file.read(n)
        if len(data) != n:
            raise self.fail(f"ends inside the header (reading {what})")
        return data

    def _unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt), what))[0]

    def _string(self, what: str) -> str:
        n = self._unpack("<Q", what)
        if n > MAX_STRING_BYTES:
            raise self.fail(f"a string of {n} bytes (reading {what})")
        try:
            return self._take(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"a string that is not UTF-8 (reading {what})") from None

    def _value(self, kind: int, what: str, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind][0], what)
        if kind == _STRING:
            return self._string(what)
        if kind == _ARRAY and depth == 0:
            item_kind = self._unpack("<I", what)
            count = self._unpack("<Q", what)
            if count > MAX_ARRAY_ITEMS:
                raise self.fail(f"an array of {count} items", what)
            if item_kind in _SCALARS:
                fmt = _SCALARS[item_kind][0]
                raw = self._take(count * struct.calcsize(fmt), what)
                return np.frombuffer(raw, fmt).tolist()
            return [self._value(item_kind, what, depth + 1) for _ in range(count)]
        raise self.fail(f"unknown value type {kind}", what)

    def _parse(self) -> None:
        if self._take(4, "the magic") != MAGIC:
            raise self.fail("not a GGUF file (no GGUF magic)")
        version = self._unpack("<I", "the version")
        if version not in VERSIONS:
            raise self.fail(f"GGUF version {version}; nybble reads versions {VERSIONS}")
        n_tensors = self._unpack("<Q", "the tensor count")
        n_meta = self._unpack("<Q", "the metadata count")
        if n_tensors > MAX_TENSORS or n_meta > MAX_METADATA:
            raise self.fail(f"claims {n_tensors} tensors and {n_meta} metadata entries")
        for _ in range(n_meta):
            key = self._string("a metadata key")
            self.metadata[key] = self._value(self._unpack("<I", key), key)
        raw: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = self._string("a tensor name")
            n_dims = self._unpack("<I", name)
            if not 1 <= n_dims <= MAX_DIMS:
                raise self.fail(f"{n_dims} dimensions", name)
            dims = tuple(self._unpack("<Q", name) for _ in range(n_dims))
            kind = self._unpack("<I", name)
            offset = self._unpack("<Q", name)
            raw.append((name, dims, kind, offset))
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise self.fail(f"alignment {alignment!r} is not a power of two", "general.alignment")
        start = -(-self._file.tell() // alignment) * alignment
        for name, dims, kind, offset in raw:
            self._add(name, dims, kind, start + offset)

    def _add(self, name: str, dims: tuple[int, ...], kind: int, offset: int) -> None:
        if name in self.tensors:
            raise self.fail("appears twice", name)
        block_type = BLOCK_TYPES.get(kind)
        if block_type is None:
            type_name = OTHER_TYPES.get(kind, f"type {kind}")
            readable = ", ".join(t.name for t in BLOCK_TYPES.values())
            raise self.fail(f"is stored as {type_name}; nybble reads {readable}", name)
        shape = tuple(reversed(dims))
        entry = TensorEntry(name, shape, block_type, offset)
        if any(d < 1 for d in dims) or entry.size % block_type.block:
            raise self.fail(f"shape {list(shape)} does not fill {block_type.name} blocks", name)
        if offset + entry.nbytes > self.size:
            raise self.fail("its data lies beyond the end of the file (truncated?)", name)
        self.tensors[name] = entry

    # --- data ---------------------------------------------------------------------------------

    def read(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, in numpy order."""
        entry = self.tensors.get(name)
        if entry is None:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        data = os.pread(self._file.fileno(), entry.nbytes, entry.offset)
        if len(data) != entry.nbytes:
            raise self.fail("its data was cut short (the file changed?)", name)
        kind = entry.kind
        blocks = np.frombuffer(data, np.uint8).reshape(-1, kind.nbytes)
        return kind.dequantize(blocks).reshape(entry.shape)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# --- as a Hugging Face model ---------------------------------------------------------------------

#: GGUF architectures nybble reads, with the HF model_type each becomes.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None for one nybble does not map."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[1].isdigit()
        and parts[3] in ("weight", "bias")
    ):
        module = _LAYER_NAMES.get(parts[2])
        if module is not None:
            return f"model.layers.{int(parts[1])}.{module}.{parts[3]}"
    return None


def hf_config(f: GGUFFile) -> dict[str, Any]:
    """The HF config.json fields the file's metadata describes (what transformers derives
    from it)."""
    meta = f.metadata
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise f.fail(
            f"architecture {arch!r} is not supported; nybble reads {', '.join(ARCHITECTURES)}",
            "general.architecture",
        )
    if "rope_freqs.weight" in f.tensors:
        raise f.fail(
            "per-frequency rotary factors (Llama 3.1 rope scaling) are not read from GGUF "
            "files; use the model's Hugging Face checkpoint",
            "rope_freqs.weight",
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise f.fail("missing", f"{arch}.{key}")
        return value

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size", len(tokens) if isinstance(tokens, list) else None)
    if vocab is None and "token_embd.weight" in f.tensors:
        vocab = f.tensors["token_embd.weight"].shape[0]
    config: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "vocab_size": vocab,
        "max_position_embeddings": get("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "hidden_act": "silu",
    }
    head_dim = meta.get(f"{arch}.attention.key_length")
    if head_dim is not None:
        config["head_dim"] = head_dim
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise f.fail(f"rope scaling {scaling!r} is not supported", f"{arch}.rope.scaling.type")
        config["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    if arch == "llama" and "blk.0.attn_q.bias" in f.tensors:
        config["attention_bias"] = True
    if arch == "qwen2":
        config["use_sliding_window"] = False
    return config


def unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows for its rotary layout (the inverse of the
    permutation its converter applies to Llama's q_proj and k_proj): per head, the
    interleaved pairs back to HF's two halves."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_metadata(f: GGUFFile) -> dict[str, Any]:
    """The `tokenizer.*` metadata (tokens, merges, token types, special token ids, the chat
    template), with the `tokenizer.ggml.` / `tokenizer.` prefixes dropped."""
    out = {}
    for key, value in f.metadata.items():
        if key.startswith("tokenizer.ggml."):
            out[key[len("tokenizer.ggml.") :]] = value
        elif key.startswith("tokenizer."):
            out[key[len("tokenizer.") :]] = value
    return out


__all__ = [
    "ARCHITECTURES",
    "BLOCK_TYPES",
    "GGUFFile",
    "TensorEntry",
    "hf_config",
    "hf_name",
    "tokenizer_metadata",
    "unpermute_rotary",
]
