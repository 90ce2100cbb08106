"""The machinery of the fuzz suites (docs/testing.md): seeds, mutators, and the classifier that
sorts each case's outcome and fails the test on what must never happen.

Every case is generated from its own random generator, seeded with (seed, target, index), so
one case can be replayed alone: the failure message gives the `NYBBLE_FUZZ_REPLAY` value.
The test suite runs every case with `FIXED_SEED`, so that a commit passes or fails the same
way on every day and machine; `python -m tests.fuzz` explores with fresh seeds
(`NYBBLE_FUZZ_SEED`), and what it finds becomes a fixed case in `REGRESSIONS`.

The outcome of a case is its class: `accepted`, or the name of the exception it raised. A case
fails the test when it ends in
- a panic of the Rust core (`pyo3_runtime.PanicException`, a BaseException);
- an exception of a type the target does not promise (json.JSONDecodeError and
  UnicodeDecodeError are ValueErrors by inheritance, but they are internal all the same: the
  allowed types are compared exactly);
- a FormatError without its `source` (or with a `field` that is not a string), a
  NonFiniteError whose `index` is not a flat index;
- an accepted input that the reference parser rejects, or whose result differs from the
  reference's (each suite's `verify`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from nybble import _core
from nybble.errors import FormatError, NonFiniteError

#: The seed every run uses (a failure in CI reproduces anywhere).
FIXED_SEED = 16_016
#: File-level cases per run, over all the mutation suites (NYBBLE_FUZZ_CASES overrides).
DEFAULT_CASES = 24_000

ACCEPTED = "accepted"
KNOWN_PREFIX = "known bug: "


#: Cases that fresh seeds once found failing, replayed by every run: suite name ->
#: (seed, index) pairs (the `NYBBLE_FUZZ_REPLAY` value of the failure, split).
REGRESSIONS: dict[str, list[tuple[int, int]]] = {
    # a shape [0, 10**k]: empty, but one dimension numpy cannot hold (accepted, then
    # dequantize raised numpy's "Maximum allowed dimension exceeded")
    "bnb-state": [(1602605423, 5813), (1602605423, 7149)],
    # framework "nybble" at 16M tokens: refused by the replay's bound (ReplayLimitError)
    "estimator": [(2351096861, 3445)],
}


def exploring_seed() -> int | None:
    """NYBBLE_FUZZ_SEED (decimal or 0x...), set by `python -m tests.fuzz`; None otherwise."""
    given = os.environ.get("NYBBLE_FUZZ_SEED")
    return int(given, 0) if given else None


def run_seeds(fixed: int = FIXED_SEED) -> list[int]:
    """The seeds a run uses: `fixed` in the test suite (never anything that depends on the
    date or the machine), only the exploring seed under `python -m tests.fuzz`."""
    exploring = exploring_seed()
    return [fixed] if exploring is None else [exploring]


def cases_for(share: float) -> int:
    """This suite's share of NYBBLE_FUZZ_CASES (default DEFAULT_CASES), over all its seeds."""
    total = int(os.environ.get("NYBBLE_FUZZ_CASES", DEFAULT_CASES))
    return max(1, round(total * share))


def scaled_examples(default: int) -> int:
    """Hypothesis examples for a codec property, scaled as NYBBLE_FUZZ_CASES scales the
    mutation suites."""
    total = int(os.environ.get("NYBBLE_FUZZ_CASES", DEFAULT_CASES))
    return max(1, round(default * total / DEFAULT_CASES))


@contextlib.contextmanager
def scratch_directory(fallback: Path) -> Iterator[Path]:
    """A directory for the cases' files: in memory (/dev/shm) where there is one, since a
    suite writes thousands of small files and a disk mounted with `discard` takes about a
    millisecond to free each; `fallback` (a pytest tmp_path) otherwise."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        path = Path(tempfile.mkdtemp(prefix="nybble-fuzz-", dir=shm))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)
    else:
        yield fallback


def case_rng(target: str, seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, zlib.crc32(target.encode()), index])


# --- outcomes ------------------------------------------------------------------------------------


def _panic_type() -> type[BaseException]:
    """pyo3's PanicException, from a deliberate panic (its report to stderr silenced)."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        _core._panic("probe")
    except BaseException as e:
        return type(e)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    raise AssertionError("_core._panic returned")


PANIC = _panic_type()

#: What a malformed file or state may end in.
FILE_ERRORS: tuple[type[BaseException], ...] = (FormatError, NonFiniteError)
#: What bad arguments may end in.
ARGUMENT_ERRORS: tuple[type[BaseException], ...] = (
    FormatError,
    NonFiniteError,
    ValueError,
    KeyError,
    TypeError,
)


def outcome_class(error: BaseException | None) -> str:
    """`accepted`, or the exception's type: its name for builtins and nybble's types, its
    module and name otherwise (`re.error`, `json.decoder.JSONDecodeError`)."""
    if error is None:
        return ACCEPTED
    kind = type(error)
    if kind.__module__ == "builtins" or kind.__module__.split(".")[0] == "nybble":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def problem_with(error: BaseException, allowed: Sequence[type[BaseException]]) -> str | None:
    """Why an exception is not an acceptable end for a case, or None when it is."""
    if isinstance(error, PANIC):
        return f"panic: {error}"
    kind = type(error)
    if kind not in allowed:
        return f"internal error type {kind.__module__}.{kind.__qualname__}: {error!r}"[:600]
    source, field = getattr(error, "source", None), getattr(error, "field", None)
    if isinstance(error, FormatError) and (
        not isinstance(source, str)
        or not source
        or not (field is None or isinstance(field, str))
        or not isinstance(getattr(error, "problem", None), str)
    ):
        return f"FormatError without a source or with a bad field: {error!r}"
    index = getattr(error, "index", None)
    if isinstance(error, NonFiniteError) and (not isinstance(index, int) or index < 0):
        return f"NonFiniteError with index {index!r}"
    return None


Case = TypeVar("Case")


@dataclass
class Suite(Generic[Case]):
    """One fuzz target. `generate(rng)` makes a case (with a `description` attribute saying
    how it was made); `attempt(case)` runs nybble on it and returns what it made; `verify(case,
    result)` checks an accepted case against the reference (a problem string, or None);
    `refused(case, error)` may check a refused one (a problem string, or None); `known(case,
    error)` names a known bug the case shows (counted, not failed: each has a strict xfail
    test of its own)."""

    name: str
    generate: Callable[[np.random.Generator], Case]
    attempt: Callable[[Case], Any]
    verify: Callable[[Case, Any], str | None]
    allowed: Sequence[type[BaseException]] = FILE_ERRORS
    refused: Callable[[Case, BaseException], str | None] | None = None
    known: Callable[[Case, BaseException | None], str | None] | None = None


@dataclass
class Tally:
    """Cases per outcome class of one suite, and its failures."""

    name: str
    counts: Counter[str] = field(default_factory=Counter)
    #: The first failures, described; `failed` counts them all.
    failures: list[str] = field(default_factory=list)
    failed: int = 0
    #: Failing cases by kind of failure (what the problem says before its first colon).
    reasons: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def cases(self) -> int:
        return sum(self.counts.values())


def describe(case: Any) -> str:
    text = str(getattr(case, "description", case))
    return text if len(text) <= 300 else text[:297] + "..."


def run_case(suite: Suite[Any], case: Any) -> tuple[str, str | None]:
    """(class, failure or None) of one case."""
    error: BaseException | None = None
    result: Any = None
    try:
        result = suite.attempt(case)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # a panic is a BaseException
        error = e
    cls = outcome_class(error)
    if suite.known is not None:
        bug = suite.known(case, error)
        if bug is not None:
            return KNOWN_PREFIX + bug, None
    if error is None:
        try:
            return cls, suite.verify(case, result)
        except Exception as e:  # the reference could not follow what nybble accepted
            return cls, f"accepted, and the reference check cannot read it: {e!r}"[:600]
    problem = problem_with(error, suite.allowed)
    if problem is None and suite.refused is not None:
        problem = suite.refused(case, error)
    return cls, problem


def run_suite(suite: Suite[Any], cases: int, max_failures: int = 20) -> Tally:
    """`cases` cases split over the run's seeds (see the module docstring); or, with
    NYBBLE_FUZZ_REPLAY=<suite>:<seed>:<index>, that one case, its exception re-raised."""
    tally = Tally(suite.name)
    replay = os.environ.get("NYBBLE_FUZZ_REPLAY")
    if replay:
        name, seed, index = replay.rsplit(":", 2)
        if name == suite.name:
            case = suite.generate(case_rng(name, int(seed, 0), int(index)))
            print(f"replaying {replay}: {describe(case)}")
            result = suite.attempt(case)  # raises what the case raises
            problem = suite.verify(case, result)
            assert problem is None, problem
        return tally
    started = time.perf_counter()
    seeds = run_seeds()
    keys = [(seed, index) for seed in seeds for index in range(cases // len(seeds))]
    if exploring_seed() is None:
        keys += REGRESSIONS.get(suite.name, [])
    for seed, index in keys:
        case = suite.generate(case_rng(suite.name, seed, index))
        cls, problem = run_case(suite, case)
        tally.counts[cls] += 1
        if problem is None:
            continue
        tally.failed += 1
        tally.reasons[_reason(problem)] += 1
        if len(tally.failures) < max_failures:
            tally.failures.append(
                f"{problem}\n    case: {describe(case)}\n    replay: "
                f"NYBBLE_FUZZ_REPLAY={suite.name}:{seed}:{index}"
            )
    tally.seconds = time.perf_counter() - started
    return tally


def report(tallies: Sequence[Tally]) -> str:
    """The outcome table: cases per class for each suite (and how many of them failed), and
    the seeds used."""
    classes = sorted({c for t in tallies for c in t.counts}, key=_class_order)
    headers = ["suite", "cases", *classes, "failed", "seconds"]
    rows = [
        [
            t.name,
            str(t.cases),
            *(str(t.counts.get(c, 0)) for c in classes),
            str(t.failed),
            f"{t.seconds:.1f}",
        ]
        for t in tallies
    ]
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    lines = [
        f"fuzz outcomes (seed {', '.join(str(s) for s in run_seeds())}; "
        "python -m tests.fuzz explores others)",
        "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    for t in tallies:
        if t.reasons:
            lines.append(f"{t.name} failures by kind:")
            lines += [f"  {n:6d}  {reason}" for reason, n in t.reasons.most_common()]
    return "\n".join(lines)


def _reason(problem: str) -> str:
    head = problem.split(":", 1)[0]
    return head if len(head) <= 70 else head[:67] + "..."


def _class_order(name: str) -> tuple[int, str]:
    if name == ACCEPTED:
        return (0, name)
    if name in ("FormatError", "NonFiniteError", "ValueError", "KeyError", "TypeError"):
        return (1, name)
    return (2, name)


#: Seeds the harness checks run the generators over: fresh seeds are the fuzz command's, so the
#: generators must make a case from any seed (a case that breaks the harness itself would
#: fail the fuzz run for a reason that is not the library's).
HARNESS_SEEDS = (1, 2, 20_261_128, 2**32 + 5, 0xDEADBEEF)


def check_generator(name: str, generate: Callable[[np.random.Generator], Any], cases: int) -> None:
    """`generate` makes `cases` cases per harness seed without raising or warning (warnings
    are errors in the test run), each describable."""
    for seed in HARNESS_SEEDS:
        for index in range(cases):
            try:
                describe(generate(case_rng(name, seed, index)))
            except Exception as e:
                raise AssertionError(
                    f"the {name} generator failed on seed {seed}, case {index}: {e!r}"
                ) from e


def check(tallies: Sequence[Tally]) -> None:
    """Prints the outcome table and fails with every suite's failures."""
    print("\n" + report(tallies))
    failures = [f"[{t.name}] {f}" for t in tallies for f in t.failures]
    total = sum(t.failed for t in tallies)
    assert not failures, f"{total} fuzz failure(s), the first:\n" + "\n".join(failures)


# --- reference parsing ---------------------------------------------------------------------------


def strict_json(data: bytes) -> Any:
    """The reference for JSON files: Python's json module reading the bytes as it reads any
    (UTF-8, -16 or -32, a byte order mark allowed), but without NaN, Infinity and -Infinity,
    which JSON (RFC 8259) does not have. Raises ValueError for anything else. A number beyond
    a double's range (1e999) is grammatical JSON: it is for the reader of the field to refuse."""

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(data, parse_constant=constant)


def strict_json_or_none(data: bytes) -> tuple[bool, Any]:
    """(True, value) when `data` is strict JSON, (False, None) otherwise."""
    try:
        return True, strict_json(data)
    except (ValueError, RecursionError):
        return False, None


# --- mutators: bytes ----------------------------------------------------------------------------

_INTERESTING_BYTES = b'\x00\x01\x7f\x80\xff "{}[],:0123456789-.eE\\'


def mutate_bytes(
    data: bytes, rng: np.random.Generator, region: tuple[int, int] | None = None
) -> tuple[bytes, str]:
    """One random byte-level change of `data` (within `region`, [begin, end), when given)."""
    lo, hi = region if region is not None else (0, len(data))
    hi = max(hi, lo)
    pos = int(rng.integers(lo, hi + 1)) if hi > lo else lo
    kind = str(rng.choice(["flip", "set", "truncate", "insert", "delete", "duplicate", "append"]))
    b = bytearray(data)
    if kind == "flip" and pos < len(b):
        bit = int(rng.integers(8))
        b[pos] ^= 1 << bit
        return bytes(b), f"bit {bit} of byte {pos} flipped"
    if kind == "set" and pos < len(b):
        value = _INTERESTING_BYTES[int(rng.integers(len(_INTERESTING_BYTES)))]
        b[pos] = value
        return bytes(b), f"byte {pos} set to {value:#04x}"
    if kind == "truncate":
        return bytes(b[:pos]), f"truncated to {pos} bytes"
    if kind == "insert":
        size = int(rng.choice([1, 2, 4, 8, 16]))
        junk = bytes(rng.integers(0, 256, size, dtype=np.uint8))
        return bytes(b[:pos]) + junk + bytes(b[pos:]), f"{size} bytes inserted at {pos}"
    if kind == "delete":
        size = int(rng.choice([1, 2, 4, 8, 64]))
        return bytes(b[:pos]) + bytes(b[pos + size :]), f"{size} bytes deleted at {pos}"
    if kind == "duplicate":
        size = int(rng.choice([1, 4, 16, 64]))
        return bytes(b[:pos]) + bytes(b[pos : pos + size]) * 2 + bytes(
            b[pos + size :]
        ), f"{size} bytes at {pos} doubled"
    junk = bytes(rng.integers(0, 256, int(rng.choice([1, 7, 64])), dtype=np.uint8))
    return bytes(b) + junk, f"{len(junk)} bytes appended"


# --- mutators: JSON -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """JSON text written as it is: NaN, Infinity, numbers too large for a double, deep nesting."""

    text: str


DEEP = Raw("[" * 100_000 + "]" * 100_000)
RAW_VALUES = [
    Raw("NaN"),
    Raw("Infinity"),
    Raw("-Infinity"),
    Raw("1e999"),
    Raw("-1e999"),
    Raw("1" + "0" * 400),
    Raw("9" * 5000),
    Raw("1E400"),
    Raw("-0"),
    Raw("0.0000000000000000000000000000000000000000000001e-400"),
    DEEP,
    Raw('{"a":' * 3000 + "1" + "}" * 3000),
]

HOSTILE_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    3,
    64,
    255,
    2**31 - 1,
    2**31,
    2**53 + 1,
    2**63,
    2**64,
    -(2**63),
    10**30,
    0.0,
    -0.0,
    0.5,
    1.5,
    2.0,
    64.0,
    1e-310,
    1e308,
    -1e308,
    3.5e38,
    "",
    "0",
    "1",
    "8",
    "true",
    "false",
    "no",
    "null",
    "NaN",
    "nf4",
    "fp4",
    "float32",
    "bfloat16",
    "torch.float16",
    "q_proj",
    "all-linear",
    "(",
    "é",
    "\u0000",
    [],
    [1],
    [1, 2],
    [-1, 2],
    ["q_proj"],
    ["q_proj", 1],
    [None],
    [[1]],
    {},
    {"a": 1},
    {"q_proj": 2},
]

#: Regular expressions, good and bad, for fields that hold one.
REGEXES = [
    "q_proj",
    ".*q_proj",
    "model\\..*",
    ".*",
    "",
    "(",
    ")",
    "[",
    "*",
    "+q",
    "\\",
    "(?P<",
    "a{2,1}",
    "(?<=a+)b",
    "a{4294967296}",
    "(?i)Q_PROJ",
    "q_proj|v_proj",
    "layers\\.0\\..*",
    "\\d+",
    "é",
    "(?P<n>q)(?P=n)",
    "\x00",
]


def hostile_value(rng: np.random.Generator) -> Any:
    if rng.random() < 0.15:
        return RAW_VALUES[int(rng.integers(len(RAW_VALUES)))]
    return HOSTILE_VALUES[int(rng.integers(len(HOSTILE_VALUES)))]


def dumps(value: Any) -> str:
    """JSON text of a value that may hold Raw pieces."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        value = value[p]
    return value


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def mutate_json(
    doc: Any,
    rng: np.random.Generator,
    fields: Sequence[str] = (),
    values: Callable[[np.random.Generator, str], Any] | None = None,
) -> tuple[Any, str]:
    """One structural change of a JSON document (a copy): a value replaced, a key removed,
    added or renamed, a value wrapped. Top-level `fields` are picked more often (and created
    when missing); `values(rng, field)` gives field-specific candidates."""
    doc = _copy(doc)

    def value_for(name: str) -> Any:
        if values is not None and rng.random() < 0.6:
            return values(rng, name)
        return hostile_value(rng)

    if isinstance(doc, dict) and fields and rng.random() < 0.6:
        name = str(rng.choice(list(fields)))
        roll = rng.random()
        if roll < 0.75:
            doc[name] = value_for(name)
            return doc, f"{name} = {_short(doc[name])}"
        if roll < 0.9:
            doc.pop(name, None)
            return doc, f"{name} removed"
        if name in doc:
            doc[name] = [doc[name]]
            return doc, f"{name} wrapped in a list"
    paths = _paths(doc)
    path = paths[int(rng.integers(len(paths)))]
    kind = str(rng.choice(["replace", "remove", "add", "rename", "whole"]))
    where = ".".join(str(p) for p in path) or "<document>"
    if kind == "whole":
        return hostile_value(rng), "document replaced"
    if not path:
        kind = "add"
    if kind == "add":
        parent = _get(doc, path)
        if isinstance(parent, dict):
            key = str(rng.choice(["unknown_field", "", "__proto__", "r ", "R", "lora_alpha "]))
            parent[key] = hostile_value(rng)
            return doc, f"{where}: key {key!r} added"
        if isinstance(parent, list):
            parent.append(hostile_value(rng))
            return doc, f"{where}: element appended"
        kind = "replace"
        path = path or ()
    if not path:
        return hostile_value(rng), "document replaced"
    parent = _get(doc, path[:-1])
    last = path[-1]
    if kind == "remove":
        del parent[last]
        return doc, f"{where} removed"
    if kind == "rename" and isinstance(parent, dict):
        new = str(rng.choice([last.upper(), last + "_", "_" + last, last.replace("_", "-"), ""]))
        parent[new] = parent.pop(last)
        return doc, f"{where} renamed {new!r}"
    parent[last] = value_for(str(last))
    return doc, f"{where} = {_short(parent[last])}"


def _short(value: Any) -> str:
    text = dumps(value)
    return text if len(text) <= 60 else text[:40] + f"... ({len(text)} chars)"


def mutate_json_text(text: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """One change of JSON text as bytes: an encoding other than UTF-8, a byte order mark,
    trailing garbage, a duplicated key, or a byte-level change."""
    kind = str(rng.choice(["bytes", "bytes", "bytes", "utf16", "bom", "latin1", "trailing", "dup"]))
    if kind == "utf16":
        return text.decode("utf-8", "replace").encode("utf-16"), "encoded as UTF-16"
    if kind == "bom":
        return b"\xef\xbb\xbf" + text, "UTF-8 byte order mark"
    if kind == "latin1":
        return text.replace(b'"', b'"\xe9', 1), "a byte that is not UTF-8"
    if kind == "trailing":
        junk = [b" x", b"{}", b"\x00", b"]", b" // comment"][int(rng.integers(5))]
        return text + junk, f"{junk!r} after the document"
    if kind == "dup":
        stripped = text.rstrip()
        if stripped.endswith(b"}") and b":" in stripped:
            head, _, _ = stripped[1:].partition(b",")
            return stripped[:-1] + b", " + head.strip() + b"}", "first key repeated at the end"
    return mutate_bytes(text, rng)


# --- safetensors files ----------------------------------------------------------------------------


def split_safetensors(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, data after it) of a well-formed file."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join_safetensors(header: Any, body: bytes, length_delta: int = 0) -> bytes:
    text = dumps(header).encode("utf-8")
    return struct.pack("<Q", max(0, len(text) + length_delta)) + text + body


def pick(rng: np.random.Generator, options: Sequence[Any]) -> Any:
    return options[int(rng.integers(len(options)))]
