"""The small training corpus `nybble train` uses: English-like sentences generated from a fixed
grammar by a fixed generator, as bytes (token = byte, vocab 256 = the tiny model's), and the
batches drawn from it. Nothing is random across runs or machines: the corpus is always the
same text, and batch `i` of a seed is always the same windows of it (a SplitMix64 hash of
seed and index picks them), so a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import functools

import numpy as np

_SUBJECTS = (
    "the cat", "a dog", "the old man", "my sister", "the river", "a small bird", "the teacher",
    "our neighbour", "the wind", "a stranger", "the children", "the baker", "her brother",
    "the fox", "a sailor", "the queen",
)  # fmt: skip
_VERBS = (
    "sees", "follows", "paints", "remembers", "carries", "watches", "finds", "loses", "wants",
    "hears", "builds", "forgets", "brings", "calls", "likes", "keeps",
)  # fmt: skip
_OBJECTS = (
    "the red ball", "a letter", "the bread", "an apple", "the lamp", "a song", "the key",
    "the boat", "a blue coat", "the map", "some flowers", "the clock", "a story", "the bell",
    "a stone", "the kite",
)  # fmt: skip
_PLACES = (
    "in the garden", "near the station", "by the sea", "at noon", "after dinner",
    "in the morning", "under the bridge", "on the hill", "before the rain", "at the market",
    "in the kitchen", "across the field", "at night", "behind the house", "in winter",
    "on sunday",
)  # fmt: skip
_ENDINGS = (".", ".", ".", "!", "?")
#: Bytes of the corpus; the last HOLDOUT_FRACTION of it is kept out of training batches.
CORPUS_BYTES = 1 << 16
HOLDOUT_FRACTION = 16
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's output function: a fixed, well-mixed 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@functools.cache
def corpus(size: int = CORPUS_BYTES) -> np.ndarray:
    """`size` bytes of generated sentences (uint8, read-only): the same on every machine."""
    if size < 2:
        raise ValueError(f"size must be at least 2 bytes, got {size}")
    parts: list[str] = []
    length = 0
    state = 0
    while length < size:
        words = []
        for table in (_SUBJECTS, _VERBS, _OBJECTS, _PLACES, _ENDINGS):
            state = _splitmix64(state)
            words.append(table[state % len(table)])
        subject, verb, obj, place, end = words
        sentence = f"{subject.capitalize()} {verb} {obj} {place}{end} "
        parts.append(sentence)
        length += len(sentence)
    out = np.frombuffer("".join(parts).encode("ascii")[:size], np.uint8).copy()
    out.flags.writeable = False
    return out


def corpus_batch(
    index: int, batch_size: int, seq_len: int, seed: int = 0, holdout: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Batch `index` of a seed: `batch_size` windows of `seq_len` bytes as inputs and the
    bytes that follow them as targets (int64 [batch_size, seq_len]). Training windows come
    from the first (HOLDOUT_FRACTION-1)/HOLDOUT_FRACTION of the corpus, held-out ones
    (`holdout`) from the rest."""
    for name, value in (("index", index), ("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (name != "index"):
            raise ValueError(f"{name} must be an integer >= {int(name != 'index')}, got {value!r}")
    text = corpus()
    split = len(text) - len(text) // HOLDOUT_FRACTION
    lo, hi = (split, len(text)) if holdout else (0, split)
    span = hi - lo - seq_len - 1
    if span < 1:
        raise ValueError(
            f"seq_len {seq_len} is too long for the corpus ({hi - lo} bytes in this split)"
        )
    key = _splitmix64((seed << 1 | holdout) & _MASK64) ^ index
    starts = [lo + _splitmix64((key + b * 0x632BE59BD9B4E019) & _MASK64) % span
              for b in range(batch_size)]  # fmt: skip
    windows = np.stack([text[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    return windows[:, :-1], windows[:, 1:]


__all__ = ["CORPUS_BYTES", "corpus", "corpus_batch"]
