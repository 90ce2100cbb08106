"""The allocations of nybble's own GPU trainer, read off a run of the trainer's own code: a
`nybble.train.Trainer(..., device="cuda")` built and trained on the recording backend
(`nybble.backends.record`), whose arrays record their allocations and frees and hold no
values. There is no second description of the trainer here: what the trainer's code
allocates, in its order, is what the estimate replays through the CuPy pool simulation
(`cupy_pool`), so a change to the trainer changes the estimate.

What this module adds to the run:
- the weights as shapes (`ShapeWeights`: the trainer's `WeightSource` whose host arrays hold
  nothing), so a 70B model is "loaded" without reading or allocating anything;
- nothing for train/_cuda.py, the trainer's fused GPU kernels: they reach the GPU through
  `backends.get("cuda")`, the recording during a run, so their own code allocates their
  outputs and workspaces on it, and their launches do nothing;
- the breakdown's parts: each allocation is tagged with the part of the step it is made in
  (forward and backward: activations; the LM head's loss: logits; the optimizer's step), and
  what outlives the step is tagged by what holds it (the weights, the adapters, their
  gradients, the optimizer's moments; `_tag_owned`);
- the phases of the step, marked where the trainer enters its loss, its backward and its
  optimizer step.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..backends.record import RecordArray, RecordingBackend
from ..formats import numpy_dtype
from ..train import _cuda
from .cupy_pool import round_size
from .parts import (
    ACTIVATIONS,
    GRADIENTS,
    LOGITS_LOSS,
    LORA_PARAMS,
    OPTIMIZER_STATES,
    QUANT_CONSTANTS,
    QUANTIZED_WEIGHTS,
    RUNTIME_OVERHEAD,
    UNQUANTIZED_WEIGHTS,
)
from .quant import FLOAT_FORMATS
from .setup import TrainingSetup
from .timeline import Event, Tape

#: A recorded step walks every chunk of the trainer's attention and loss (tens of microseconds
#: each): a setup whose training step has more chunks than this is refused at once rather than
#: left running (a million tokens of the tiny model make 750,000 a step).
MAX_CHUNKS_PER_STEP = 1 << 15
#: The recorded run's token ids are real host arrays (the trainer checks them): at most this
#: many tokens a step (16 MiB of ids), far beyond any step one GPU trains.
MAX_TOKENS_PER_STEP = 1 << 21


class ReplayLimitError(ValueError):
    """A setup whose recorded step would walk more than `MAX_CHUNKS_PER_STEP` chunks.
    `max_seq_len` (at the setup's batch) and `max_batch` (at its seq_len) are the largest the
    estimate takes, 0 where none is."""

    def __init__(self, message: str, max_seq_len: int, max_batch: int) -> None:
        super().__init__(message)
        self.max_seq_len = max_seq_len
        self.max_batch = max_batch


def chunks_per_step(s: TrainingSetup) -> int:
    """Chunks of attention scores and of logits one training step walks: per layer the
    forward, the backward and, with checkpointing, the forward again, each over
    `functional.attention_chunks` (none where the trainer's kernels take the whole attention
    at once: `_whole_attention`); then the loss over `functional.head_chunks` (their counts,
    without making their lists)."""
    from ..train import functional as F

    a = s.arch
    rows = max(1, min(s.tokens, F.HEAD_CHUNK_ELEMENTS // max(1, a.vocab_size)))
    loss = -(-s.tokens // rows)
    nb, group = s.batch * a.num_kv_heads, a.num_heads // a.num_kv_heads
    if _whole_attention(nb, s.seq_len, group, a.head_dim, s.compute_dtype):
        return loss
    per_position = max(1, nb * group * s.seq_len)
    step = max(1, min(s.seq_len, F.ATTENTION_CHUNK_ELEMENTS // per_position))
    passes = a.num_layers * (3 if s.grad_checkpointing else 2)
    return passes * -(-s.seq_len // step) + loss


@functools.lru_cache(maxsize=256)
def _whole_attention(nb: int, positions: int, group: int, head_dim: int, dtype: str) -> bool:
    """Whether the trainer's GPU kernels take the whole attention of these shapes at once
    (`functional.attention_forward` asks its softmax object's `flash_forward` first; it
    returns None where its kernels do not apply), asked of the kernels on a recording that
    records nothing."""
    probe = RecordingBackend(None)
    with probe.standing_in():
        softmax = _cuda.FusedSoftmax()
        flash = getattr(softmax, "flash_forward", None)
        if flash is None:
            return False
        xp, dt = probe.xp, numpy_dtype(dtype)
        q = xp.empty((nb, 1, positions, group, head_dim), dt)
        k = xp.empty((nb, 1, positions, head_dim), dt)
        return flash(q, k, k, 1.0, None, None) is not None


def _largest(fits: Callable[[int], bool], hi: int) -> int:
    """Largest n in [1, hi] with fits(n) (monotone), 0 if none."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def recordable(s: TrainingSetup) -> bool:
    """Whether a step of `s` is within what a recorded run takes (`MAX_CHUNKS_PER_STEP`,
    `MAX_TOKENS_PER_STEP`); both grow with batch and seq_len."""
    return s.tokens <= MAX_TOKENS_PER_STEP and chunks_per_step(s) <= MAX_CHUNKS_PER_STEP


def check_replay_size(s: TrainingSetup) -> None:
    """ReplayLimitError, stating the bound, for a setup beyond what a recorded run takes."""
    if recordable(s):
        return
    seq = _largest(lambda x: recordable(s.with_(seq_len=x)), s.seq_len)
    batch = _largest(lambda x: recordable(s.with_(batch=x)), s.batch)
    at = f"at batch {s.batch}: seq_len up to {seq}" if seq else f"batch {s.batch} is too large"
    raise ReplayLimitError(
        f"framework 'nybble' records every chunk of the trainer's attention and loss: batch "
        f"{s.batch} x seq_len {s.seq_len} makes {chunks_per_step(s):,} chunks a training step "
        f"and {s.tokens:,} tokens, more than the {MAX_CHUNKS_PER_STEP:,} chunks and "
        f"{MAX_TOKENS_PER_STEP:,} tokens it records (the attention's chunks grow with batch x "
        f"heads x seq_len^2 x layers where it is not taken whole, the loss's with batch x "
        f"seq_len x vocab); this model takes, {at}"
        + (f"; at seq_len {s.seq_len}: batch up to {batch}" if batch else ""),
        max_seq_len=seq,
        max_batch=batch,
    )


def supported(s: TrainingSetup) -> None:
    """ValueError naming the setting nybble's trainer does not have."""
    problems = []
    if s.arch.is_moe:
        problems.append("mixtures of experts (the trainer's model has dense MLPs only)")
    if s.quant not in ("nf4", *FLOAT_FORMATS):
        problems.append(f"quant {s.quant!r} (the trainer stores bases in nf4 or a float dtype)")
    if s.quant == "nf4" and s.blocksize != 64:
        problems.append(f"blocksize {s.blocksize} (the GPU kernels take 64)")
    if s.compute_dtype not in ("bfloat16", "float32"):
        problems.append(f"compute_dtype {s.compute_dtype!r} (bfloat16 or float32)")
    if s.lora_dtype != "float32":
        problems.append(f"lora_dtype {s.lora_dtype!r} (adapters train in float32)")
    if s.optimizer != "adamw":
        problems.append(f"optimizer {s.optimizer!r} (the trainer's AdamW)")
    if s.loop != "plain":
        problems.append(f"loop {s.loop!r} (the trainer's own loop: 'plain')")
    if s.arch.qkv_bias or s.arch.o_bias or s.arch.mlp_bias:
        problems.append("linear biases (the trainer's projections have none)")
    if problems:
        raise ValueError("framework 'nybble' does not model " + "; ".join(problems))


# --- the run's inputs ---------------------------------------------------------------------


class ShapeWeights:
    """The trainer's WeightSource for a recorded run: every weight a host array of the
    recording (its shape and dtype, no values), quantized by the recording backend."""

    def __init__(self, host: RecordingBackend) -> None:
        self.host = host

    def matrix(self, name: str, shape: tuple[int, int]) -> Any:
        return self.host.xp.empty(shape, np.float32)

    def vector(self, name: str, size: int, fill: float) -> Any:
        return self.host.xp.empty(size, np.float32)

    def quantized(
        self, name: str, shape: tuple[int, int], blocksize: int, double_quant: bool
    ) -> Any:
        from ..tensor import quantize

        return quantize(self.matrix(name, shape), blocksize=blocksize, double_quant=double_quant)


def _around(obj: Any, name: str, before: Callable[[], None], after: Callable[[], None]) -> None:
    """obj.name (a method) wrapped: `before` is called on the way in, `after` on the way out."""
    method = getattr(obj, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        before()
        try:
            return method(*args, **kwargs)
        finally:
            after()

    setattr(obj, name, wrapped)


def transformer_config(s: TrainingSetup) -> Any:
    """The trainer's model config for the setup's architecture (a type the trainer does not
    have, refused by `supported` anyway, as a Llama)."""
    from ..train.config import MODEL_TYPES, TransformerConfig

    a = s.arch
    return TransformerConfig(
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        vocab_size=a.vocab_size,
        tie_word_embeddings=a.tie_word_embeddings,
        qk_norm=a.qk_norm,
        model_type=a.model_type if a.model_type in MODEL_TYPES else "llama",
    )


# --- the run -----------------------------------------------------------------------------


class TrainerRun:
    """`Trainer(...).train_batch` steps of one setup on the recording backend: `setup()`
    builds the trainer, each `step()` trains one batch, and each leaves its allocations and
    frees on `tape` (frameworks.replay_until_steady's Timeline)."""

    def __init__(self, s: TrainingSetup, repeat: bool = True) -> None:
        supported(s)
        check_replay_size(s)
        self.s = s
        self.tape = Tape()
        self.steps_done = 0
        self._recorder = _TapeRecorder(self.tape)
        self.backend = RecordingBackend.gpu(self._recorder)
        self.trainer: Any = None
        self._tags: list[str] = []
        self.ids = np.zeros((s.batch, s.seq_len), np.int64)
        #: whether steps after the second repeat its allocations (`_Period`) rather than run
        self.repeat = repeat
        self._steps: list[tuple[list[Event], set[int]]] = []  # recorded: events, alive at end
        self._period: _Period | None = None

    @contextlib.contextmanager
    def _recording(self) -> Iterator[None]:
        """The recording stands in for the GPU; frees come from reference counts alone (no
        collection of cycles in between), as the trainer's arrays on the GPU go."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            with self.backend.standing_in():
                yield
        finally:
            if collecting:
                gc.enable()

    def setup(self) -> None:
        """The trainer built: its model (weights, adapters, the flat parameter buffer and its
        gradient) and AdamW's states."""
        from ..lora.config import LoraConfig
        from ..train import Trainer

        s = self.s
        self.tape.tag = UNQUANTIZED_WEIGHTS
        with self._recording():
            trainer = Trainer(
                transformer_config(s),
                LoraConfig(
                    r=s.lora_r,
                    alpha=2 * s.lora_r,
                    dropout=s.lora_dropout,
                    target_modules=tuple(s.targets),
                ),
                lr=1e-4,
                quant="nf4" if s.quant == "nf4" else None,
                device="cuda",
                compute_dtype=s.compute_dtype,
                gradient_checkpointing=s.grad_checkpointing,
                blocksize=s.blocksize if s.quant == "nf4" else 64,
                double_quant=s.double_quant,
                weights=ShapeWeights(self.backend.host()),
            )
        self.trainer = trainer
        self._mark_phases()
        self._tag_owned()
        self.tape.tag = ACTIVATIONS

    def step(self) -> None:
        """One `Trainer.train_batch`: recorded, or from the third on (`repeat`), the second's
        allocations again where the trainer's state repeats from step to step (`_Period`)."""
        self.steps_done += 1
        if self._period is not None:
            self._period.next(self.tape, self.steps_done)
            return
        start = len(self.tape.events)
        alive_before = set(self._alive)
        self.tape.step(self.steps_done)
        self.tape.phase("forward")
        self.tape.tag = ACTIVATIONS
        with self._recording():
            self.trainer.train_batch(self.ids, self.ids)
        self._tag_owned()
        events = self.tape.events[start:]
        self._steps.append((events, alive_before))
        if self.repeat and self.steps_done == 2:
            self._period = _Period.of(self._steps, self.tape.tags)
            if self._period is not None:
                self._recorder.tape = None  # the trainer's own arrays are done recording

    @property
    def _alive(self) -> set[int]:
        return self._recorder.alive

    # --- phases and parts ------------------------------------------------------------------

    def _enter(self, tag: str, phase: str | None = None) -> Callable[[], None]:
        def enter() -> None:
            self._tags.append(self.tape.tag)
            self.tape.tag = tag
            if phase is not None:
                self.tape.phase(phase)

        return enter

    def _leave(self, phase: str | None = None) -> Callable[[], None]:
        def leave() -> None:
            self.tape.tag = self._tags.pop()
            if phase is not None:
                self.tape.phase(phase)

        return leave

    def _mark_phases(self) -> None:
        """Where the step's parts begin: the token ids moved to the GPU (runtime overhead), the
        adapters' per-step cast (LoRA parameters), the loss (logits, from the final norm on),
        the backward after it, the optimizer's step."""
        t, m = self.trainer, self.trainer.model
        _around(t, "_batch", self._enter(RUNTIME_OVERHEAD), self._leave())
        _around(m, "cast_adapters", self._enter(LORA_PARAMS), self._leave())
        _around(m, "_final", self._enter(LOGITS_LOSS, "loss"), self._leave("backward"))
        _around(t.optimizer, "step", self._enter(OPTIMIZER_STATES, "optimizer"), self._leave())

    def _tag_owned(self) -> None:
        """What outlives the step, tagged by what holds it (the tag of the part it was made
        in stays on anything not found here)."""
        tags = self.tape.tags

        def tag(part: str, *arrays: Any) -> None:
            for a in arrays:
                if isinstance(a, RecordArray) and a._mem.key is not None:
                    tags[a._mem.key] = part

        t = self.trainer
        m = t.model
        tag(UNQUANTIZED_WEIGHTS, *m.weights.values())
        for tables in getattr(m, "_rope", {}).values():
            tag(UNQUANTIZED_WEIGHTS, *tables)
        tag(LORA_PARAMS, m.flat)
        tag(GRADIENTS, m.flat_grad)
        for layer in m.layers:
            for proj in layer.proj.values():
                lora = getattr(proj, "layer", None)
                base = lora if lora is not None else proj
                self._tag_weight(tag, getattr(base, "qweight", None), getattr(base, "weight", None))
                if lora is not None:
                    casts = getattr(getattr(lora, "_base", None), "_casts", {})
                    tag(UNQUANTIZED_WEIGHTS, *casts.values())
                    tag(GRADIENTS, lora.grad_a, lora.grad_b, lora.grad_magnitude)
                    tag(RUNTIME_OVERHEAD, *_slots(getattr(lora, "_finite", None)))
        opt = t.optimizer
        for states in (opt.m, opt.v, getattr(opt, "_accum", {})):
            tag(OPTIMIZER_STATES, *states.values())
        tag(RUNTIME_OVERHEAD, *_slots(getattr(opt, "_finite", None)))
        for kernels in vars(m).values():
            tag(RUNTIME_OVERHEAD, *getattr(kernels, "_no_weight", {}).values())
        tag(RUNTIME_OVERHEAD, *self.backend._tables.values())

    @staticmethod
    def _tag_weight(tag: Callable[..., None], q: Any, dense: Any) -> None:
        if q is not None:
            p = q.packed
            tag(QUANTIZED_WEIGHTS, p.codes)
            tag(QUANT_CONSTANTS, p.absmax)
            if p.nested is not None:
                tag(QUANT_CONSTANTS, p.nested.codes, p.nested.absmax2)
        tag(UNQUANTIZED_WEIGHTS, dense)


@functools.lru_cache(maxsize=32)
def _construction_bytes(s: TrainingSetup) -> int:
    run = TrainerRun(s, repeat=False)
    run.setup()
    sizes = {k: n for op, k, n in run.tape.events if op == "alloc"}
    return sum(round_size(sizes[k]) for k in run._alive)


def persistent_bytes(s: TrainingSetup) -> int:
    """Bytes (as CuPy's pool counts them) of what building the trainer leaves allocated: the
    weights, the adapters and AdamW's states, which no step frees. Recorded once per model and
    settings: the batch, the length and checkpointing do not change it."""
    return _construction_bytes(s.with_(batch=1, seq_len=1, grad_checkpointing=False))


def step_floor(s: TrainingSetup) -> int:
    """Bytes a step certainly holds on top of the persistent ones at its loss: each layer's
    input (kept for its backward) and the first chunk of the loss's float32 logits."""
    from ..train import functional as F

    a = s.arch
    width = FLOAT_FORMATS[s.compute_dtype]
    rows = max(1, min(s.tokens, F.HEAD_CHUNK_ELEMENTS // max(1, a.vocab_size)))
    inputs = a.num_layers * round_size(s.tokens * a.hidden_size * width)
    return inputs + round_size(rows * a.vocab_size * 4)


class _TapeRecorder:
    """The recording backend's Recorder: allocations onto a tape (tagged with its current
    part), and the keys alive; once `tape` is None (the run is over), nothing."""

    def __init__(self, tape: Tape) -> None:
        self.tape: Tape | None = tape
        self.alive: set[int] = set()

    def alloc(self, nbytes: int) -> int:
        if self.tape is None:
            return 0
        key = self.tape.alloc(nbytes)
        self.alive.add(key)
        return key

    def free(self, key: int) -> None:
        if self.tape is not None and key in self.alive:
            self.alive.discard(key)
            self.tape.free(key)


class _Period:
    """A training step's allocations, repeated: the second step's events with fresh keys,
    where the trainer's state is the same after every step from the first on. The arrays a
    step keeps for the next (the adapters' gradients) are freed by the next in the order
    they were made; `of` checks that the second step frees exactly what the first kept beyond
    its permanent arrays (same count, same sizes, in order), or finds no period."""

    def __init__(
        self, template: list[Event], kept: list[int], carried: dict[int, int], tags: dict[int, str]
    ) -> None:
        self.template = template
        self.tags = tags
        #: template keys made in the template step and alive at its end, in order
        self.kept = kept
        #: key freed by the template step but made before it -> its rank among `kept`
        self.carried = carried
        #: the actual keys of the last step's `kept`
        self.previous = list(kept)

    @classmethod
    def of(cls, steps: list[tuple[list[Event], set[int]]], tags: dict[int, str]) -> _Period | None:
        (first, _), (second, before_second) = steps[0], steps[1]
        sizes = {k: n for op, k, n in first + second if op == "alloc"}
        made_first = [k for op, k, _ in first if op == "alloc"]
        made_second = [k for op, k, _ in second if op == "alloc"]
        freed_second = {k for op, k, _ in second if op == "free"}
        # what the first step kept and the second freed, in the first's order
        carried_first = [k for k in made_first if k in before_second and k in freed_second]
        kept = [k for k in made_second if k not in freed_second]
        older = freed_second - set(made_second) - set(made_first)  # made before the steps
        if older or len(carried_first) != len(kept):
            return None
        if any(sizes[a] != sizes[b] for a, b in zip(carried_first, kept, strict=True)):
            return None
        carried = {k: i for i, k in enumerate(carried_first)}
        return cls(list(second), kept, carried, tags)

    def next(self, tape: Tape, number: int) -> None:
        """The template step's events on `tape` as step `number`."""
        fresh: dict[int, int] = {}
        tags = self.tags
        for op, key, n in self.template:
            if op == "alloc":
                fresh[key] = tape.new(n, tags[key])
            elif op == "free":
                rank = self.carried.get(key)
                tape.free(self.previous[rank] if rank is not None else fresh[key])
            elif op == "step":
                tape.step(number)
            else:
                tape.events.append((op, key, n))
        self.previous = [fresh[k] for k in self.kept]


def _slots(check: Any) -> list[Any]:
    """The device slots of a non-finite check (the recording backend's)."""
    return list(getattr(check, "_slots", {}).values())


__all__ = [
    "MAX_CHUNKS_PER_STEP",
    "MAX_TOKENS_PER_STEP",
    "ReplayLimitError",
    "ShapeWeights",
    "TrainerRun",
    "check_replay_size",
    "chunks_per_step",
    "persistent_bytes",
    "recordable",
    "step_floor",
    "supported",
]
