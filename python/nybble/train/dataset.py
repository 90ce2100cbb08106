"""Fine-tuning data: text, prompt/completion and chat files tokenized into samples, and the
samples packed into rows of a fixed length for the trainer (docs/training.md, "Data").

Files (one sample per record):
- `.txt`: documents separated by blank lines; the model learns every token.
- `.jsonl`: one JSON object per line: `{"text": ...}` (every token learned), `{"prompt": ...,
  "completion": ...}` (only the completion learned) or `{"messages": [{"role", "content"},
  ...]}` (rendered with the tokenizer's chat template; only the assistant turns learned).
- `.parquet` (with pyarrow installed): the same columns.
A record that is none of these is a FormatError naming `file:line`.

Packing: each sample of n tokens is n - 1 (input, target) pairs. Samples go in a seeded
order, one epoch after another, into rows of `seq_len` pairs; a sample that does not fit in
what is left of a row starts the next one (the rest is padding, never learned). Each token
carries the index where its sample starts in the row, so attention stays inside a sample and
rotary positions restart at 0 for each (nothing of one document leaks into another). A text
longer than a row is cut into windows of `seq_len` pairs; a prompt/completion or chat sample
longer than a row is truncated (and counted).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import _json
from ..errors import FormatError
from ..models.tokenizer import Tokenizer
from .functional import IGNORE_INDEX

SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
#: The largest line of a .jsonl file read (a longer one is an error, not a hang).
MAX_LINE_BYTES = 64 << 20


@dataclass(frozen=True)
class Sample:
    """Token ids and, for each, whether it is learned (predicted from the ones before it)."""

    ids: np.ndarray  # int32 [n]
    learn: np.ndarray  # bool [n]
    where: str  # file:line (for errors and reports)


# --- reading --------------------------------------------------------------------------------


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    """(file:line, record) of a data file: a string for .txt documents, a dict otherwise."""
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise FormatError(path, f"a data file is {', '.join(SUFFIXES)}, got {suffix or 'none'}")
    if not path.is_file():
        raise FormatError(path, "not found" if not path.exists() else "not a regular file")
    if suffix == ".parquet":
        yield from _parquet_records(path)
        return
    try:
        with open(path, "rb") as f:
            if suffix == ".txt":
                yield from _text_records(path, f)
                return
            for number, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
                if len(raw) > MAX_LINE_BYTES:
                    raise FormatError(
                        f"{path}:{number}", f"a line longer than {MAX_LINE_BYTES} bytes"
                    )
                if not raw.strip():
                    continue
                yield f"{path}:{number}", _json.loads(raw, f"{path}:{number}")
    except OSError as e:
        raise FormatError(path, f"cannot be read ({e.strerror or e})") from None


def _text_records(path: Path, f: Any) -> Iterator[tuple[str, Any]]:
    lines: list[str] = []
    first = 1
    for number, raw in enumerate(f, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{path}:{number}", "not UTF-8 text") from None
        if line.strip():
            if not lines:
                first = number
            lines.append(line)
        elif lines:
            yield f"{path}:{first}", "".join(lines).rstrip("\n")
            lines = []
    if lines:
        yield f"{path}:{first}", "".join(lines).rstrip("\n")


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("reading .parquet data needs pyarrow: pip install pyarrow") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's errors (ArrowInvalid, OSError) for a bad file
        raise FormatError(path, f"not a parquet file pyarrow reads ({e})") from None
    for number, row in enumerate(table.to_pylist(), 1):
        yield f"{path}:row {number}", row


def read_samples(path: str | os.PathLike[str], tokenizer: Tokenizer) -> list[Sample]:
    """Every record of a data file, tokenized. FormatError naming file:line for a record
    that is not text, prompt/completion or messages, or that has nothing to learn."""
    samples = []
    for where, record in _records(Path(path)):
        sample = _tokenize(where, record, tokenizer)
        if sample is not None:
            samples.append(sample)
    if not samples:
        raise FormatError(path, "holds no sample with a token to learn")
    return samples


def _text(where: str, record: Mapping[str, Any], key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise FormatError(where, f"expected a string, got {type(value).__name__}", key)
    return value


def _tokenize(where: str, record: Any, tok: Tokenizer) -> Sample | None:
    eos = [tok.eos_id] if tok.eos_id is not None else []
    if isinstance(record, str):
        record = {"text": record}
    if not isinstance(record, Mapping):
        raise FormatError(where, f"expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        return _chat_sample(where, record["messages"], tok)
    if "prompt" in record or "completion" in record:
        prompt, completion = _text(where, record, "prompt"), _text(where, record, "completion")
        ids, offsets = tok.encode_with_offsets(prompt + completion)
        # a token is learned when it starts in the completion (or is added after the text)
        learn = [start >= len(prompt) and end > start for start, end in offsets]
        return _sample(where, ids + eos, learn + [True] * len(eos))
    if "text" in record:
        ids = tok.encode(_text(where, record, "text")) + eos
        return _sample(where, ids, [True] * len(ids))
    raise FormatError(
        where,
        "a record needs `text`, `prompt` and `completion`, or `messages`; "
        f"got the keys {sorted(record)[:6]}",
    )


def _chat_sample(where: str, messages: Any, tok: Tokenizer) -> Sample | None:
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, Mapping)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise FormatError(
            where, "expected a list of {role, content} objects with string values", "messages"
        )
    try:
        full = tok.render_chat(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = tok.render_chat(messages[:i], add_generation_prompt=True) if i else ""
            through = tok.render_chat(messages[: i + 1])
            if not (full.startswith(through) and through.startswith(before)):
                raise FormatError(
                    where,
                    "the chat template does not render a conversation as the concatenation of "
                    "its turns, so the assistant's tokens cannot be told apart",
                    "messages",
                )
            spans.append((len(before), len(through)))
    except ValueError as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(where, str(e), "messages") from None
    ids, offsets = tok.encode_with_offsets(full, add_special_tokens=False)
    learn = [any(a <= start < b for a, b in spans) and end > start for start, end in offsets]
    return _sample(where, ids, learn)


def _sample(where: str, ids: Sequence[int], learn: Sequence[bool]) -> Sample | None:
    a = np.asarray(ids, np.int32)
    mask = np.asarray(learn, bool)
    mask[:1] = False  # the first token is predicted from nothing
    if a.size < 2 or not mask.any():
        return None
    return Sample(a, mask, where)


# --- packing --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """A sample cut to fit a row: `seq_len` (input, target) pairs at most."""

    inputs: np.ndarray  # int32
    targets: np.ndarray  # int32, IGNORE_INDEX where not learned


def pieces(samples: Sequence[Sample], seq_len: int) -> tuple[list[Piece], int]:
    """The pieces of the samples (texts cut into windows, other samples truncated) and the
    number of samples truncated."""
    out: list[Piece] = []
    truncated = 0
    for s in samples:
        targets = np.where(s.learn, s.ids, IGNORE_INDEX).astype(np.int32)
        n = s.ids.size - 1
        if n > seq_len and not s.learn[1:].all():
            truncated += 1
            n = seq_len
        for start in range(0, n, seq_len):
            stop = min(start + seq_len, n)
            t = targets[start + 1 : stop + 1]
            if (t != IGNORE_INDEX).any():
                out.append(Piece(s.ids[start:stop], t))
    return out, truncated


class PackedBatches:
    """Batches of packed rows, epoch after epoch: `batch(i)` is always the same for the
    same pieces, seed and sizes (a resumed run sees what it would have seen)."""

    def __init__(
        self,
        pieces: Sequence[Piece],
        seq_len: int,
        batch_size: int,
        seed: int,
        pad_id: int,
        shuffle: bool = True,
    ) -> None:
        if not pieces:
            raise ValueError("no samples to pack")
        self.pieces = list(pieces)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.pad_id = pad_id
        self.shuffle = shuffle
        self._rows: dict[int, list[list[int]]] = {}
        self.rows_per_epoch = len(self._epoch_rows(0))

    def _epoch_rows(self, epoch: int) -> list[list[int]]:
        """The pieces of each row of an epoch, in order."""
        found = self._rows.get(epoch)
        if found is not None:
            return found
        order = np.arange(len(self.pieces))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(order)
        rows: list[list[int]] = []
        used = self.seq_len
        for i in order:
            n = self.pieces[i].inputs.size
            if used + n > self.seq_len:
                rows.append([])
                used = 0
            rows[-1].append(int(i))
            used += n
        self._rows = {epoch: rows}  # one epoch kept: batches are asked for in order
        return rows

    @property
    def batches_per_epoch(self) -> float:
        return self.rows_per_epoch / self.batch_size

    def epoch_of(self, index: int) -> float:
        """The epoch (fractional) batch `index` ends in."""
        return (index + 1) * self.batch_size / self.rows_per_epoch

    def row(self, number: int) -> list[int]:
        epoch, within = divmod(number, self.rows_per_epoch)
        return self._epoch_rows(epoch)[within]

    def batch(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, targets, starts), each [batch_size, seq_len] int32: padding is pad_id in,
        IGNORE_INDEX out, a sample of its own."""
        b, t = self.batch_size, self.seq_len
        inputs = np.full((b, t), self.pad_id, np.int32)
        targets = np.full((b, t), IGNORE_INDEX, np.int32)
        starts = np.zeros((b, t), np.int32)
        for r in range(b):
            at = 0
            for i in self.row(index * b + r):
                p = self.pieces[i]
                n = p.inputs.size
                inputs[r, at : at + n] = p.inputs
                targets[r, at : at + n] = p.targets
                starts[r, at : at + n] = at
                at += n
            starts[r, at:] = at
        return inputs, targets, starts


def split_eval(
    samples: Sequence[Sample], fraction: float, seed: int
) -> tuple[list[Sample], list[Sample]]:
    """(train, eval): floor(fraction x samples) of them held out by a seeded draw (none when
    that is 0; never all)."""
    if not 0 <= fraction < 1:
        raise ValueError(f"the eval fraction must be in [0, 1), got {fraction}")
    n = len(samples)
    k = min(n - 1, math.floor(n * fraction))
    if k <= 0:
        return list(samples), []
    held = set(np.random.default_rng([seed, 0xE7A1]).choice(n, size=k, replace=False).tolist())
    return [s for i, s in enumerate(samples) if i not in held], [
        s for i, s in enumerate(samples) if i in held
    ]


def file_digest(path: str | os.PathLike[str]) -> str:
    """sha256 of a data file (a resumed run checks it trains on the same data)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


__all__ = [
    "IGNORE_INDEX",
    "PackedBatches",
    "Piece",
    "Sample",
    "file_digest",
    "pieces",
    "read_samples",
    "split_eval",
]
