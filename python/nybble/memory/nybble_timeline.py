"""The allocations of nybble's own GPU trainer (`nybble.train.Trainer`, CuPy), in order, for the
CuPy pool simulation (`cupy_pool`), each tagged with its breakdown part (`parts`).

The timeline is a shadow of the trainer's code (train/model.py, train/functional.py,
train/_cuda.py, lora/layers.py, lora/optim.py): the same functions in the same order, with
`Buf` objects standing for the device arrays. A `Buf` writes its allocation to the tape when
made and its free when CPython drops the last reference to it, so the frees come in the
order the trainer's own arrays are freed in (a rebound name frees its old array after the new
one exists; a function's locals go at its return; a view keeps its base alive). Arrays of a
few hundred bytes that live for one op are left out. Allocation traces of the real trainer
(benchmarks/memory/measure_nybble.py --trace) were compared with this one event by event.

It covers what the trainer runs: LoRA (the base in NF4, with or without double quantization,
or in a 16-bit or float32 dense copy) on any subset of the seven projections, float32
adapters, AdamW, bfloat16 or float32 activations, dropout, gradient checkpointing, the fused
GPU kernels. A training step: token ids up, the adapters' per-step cast, the forward (layer
by layer; with checkpointing only each layer's input is kept), the loss (the LM head a chunk
of rows at a time), the backward (with checkpointing each layer's forward again first), the
gathering of the gradients and AdamW.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

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
from .timeline import Tape

#: nybble.train.functional's chunk sizes (elements of one chunk of scores / logits).
ATTENTION_CHUNK_ELEMENTS = 1 << 25
HEAD_CHUNK_ELEMENTS = 1 << 25
#: The order of a decoder layer's projections (nybble.train.model.PROJECTIONS).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: A device scalar or a non-finite check's slot: one 512-byte block of the pool.
SCALAR = 8
#: The replay walks every chunk of the trainer's attention and loss, about 20 us each: a setup
#: whose training step has more chunks than this (about 6 s of replay) is refused at once
#: rather than left running (a million tokens of the tiny model make 750,000 a step).
MAX_CHUNKS_PER_STEP = 1 << 16


class ReplayLimitError(ValueError):
    """A setup whose replay would walk more than `MAX_CHUNKS_PER_STEP` chunks a step.
    `max_seq_len` (at the setup's batch) and `max_batch` (at its seq_len) are the largest the
    replay takes, 0 where none is."""

    def __init__(self, message: str, max_seq_len: int, max_batch: int) -> None:
        super().__init__(message)
        self.max_seq_len = max_seq_len
        self.max_batch = max_batch


def chunks_per_step(s: TrainingSetup) -> int:
    """Chunks of attention scores and of logits one training step walks, as the trainer (and
    `NybbleTimeline`) does: per layer the forward, the backward and, with checkpointing, the
    forward again, each over `_chunks`; then the loss over `head_cross_entropy`'s rows."""
    a = s.arch
    rows = max(1, min(s.seq_len, ATTENTION_CHUNK_ELEMENTS // (s.batch * a.num_heads * s.seq_len)))
    passes = a.num_layers * (3 if s.grad_checkpointing else 2)
    head_rows = max(1, min(s.tokens, HEAD_CHUNK_ELEMENTS // a.vocab_size))
    return passes * -(-s.seq_len // rows) + -(-s.tokens // head_rows)


def _largest(fits: Any, hi: int) -> int:
    """Largest n in [1, hi] with fits(n) (monotone), 0 if none."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def check_replay_size(s: TrainingSetup) -> None:
    """ReplayLimitError, stating the bound, for a setup beyond `MAX_CHUNKS_PER_STEP`."""
    n = chunks_per_step(s)
    if n <= MAX_CHUNKS_PER_STEP:
        return

    def ok(**changes: int) -> bool:
        return chunks_per_step(s.with_(**changes)) <= MAX_CHUNKS_PER_STEP

    seq = _largest(lambda x: ok(seq_len=x), s.seq_len)
    batch = _largest(lambda x: ok(batch=x), s.batch)
    at = f"at batch {s.batch}: seq_len up to {seq}" if seq else f"batch {s.batch} is too large"
    raise ReplayLimitError(
        f"framework 'nybble' replays every chunk of the trainer's attention and loss: batch "
        f"{s.batch} x seq_len {s.seq_len} makes {n:,} chunks a training step, more than the "
        f"{MAX_CHUNKS_PER_STEP:,} it replays (the attention's grow with batch x heads x "
        f"seq_len^2 x layers, the loss's with batch x seq_len x vocab); this model takes, {at}"
        + (f"; at seq_len {s.seq_len}: batch up to {batch}" if batch else ""),
        max_seq_len=seq,
        max_batch=batch,
    )


class Buf:
    """A device array of the shadow run: allocated when made, freed with its last reference.
    A view shares its base's memory and keeps it alive."""

    __slots__ = ("base", "key", "nbytes", "tape")

    def __init__(self, tape: Tape, nbytes: int, tag: str | None = None) -> None:
        self.tape = tape
        self.nbytes = int(nbytes)
        self.base: Buf | None = None
        self.key: int | None = tape.new(self.nbytes, tag)

    def view(self) -> Buf:
        v = Buf.__new__(Buf)
        v.tape, v.nbytes, v.key = self.tape, self.nbytes, None
        v.base = self.base or self
        return v

    def __del__(self) -> None:
        if self.key is not None:
            self.tape.free(self.key)


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


@dataclass
class _Dims:
    tokens: int
    batch: int
    seq: int
    e: int  # bytes of an activation
    r: int
    dropout: bool


class _Projection:
    """One projection of a layer: a LoRA layer over an NF4 or dense base, or a frozen base."""

    def __init__(self, tl: NybbleTimeline, out_f: int, in_f: int, lora: bool) -> None:
        self.tl, self.out_f, self.in_f, self.lora = tl, out_f, in_f, lora
        self.cache: dict[str, Any] | None = None
        self.grad_a: Buf | None = None
        self.grad_b: Buf | None = None
        self.cast: Buf | None = None  # a dense base's copy in the compute dtype
        self.slots: list[Buf] = []  # the non-finite check's device slots, made once
        tape, n = tl.tape, out_f * in_f
        self.weights: list[Buf] = []
        if tl.s.quant == "nf4":  # NF4Tensor.cuda(): the scales, then the codes
            blocks = -(-n // 64)
            if tl.s.double_quant:  # a code per block, a float32 scale per 256 blocks
                scales = [blocks, -(-blocks // 256) * 4]
            else:
                scales = [blocks * 4]
            self.weights = [Buf(tape, size, QUANT_CONSTANTS) for size in scales]
            self.weights.append(Buf(tape, n // 2, QUANTIZED_WEIGHTS))
        elif lora:  # LoraLinear keeps its own float32 copy of the base
            self.weights = [Buf(tape, n * 4, UNQUANTIZED_WEIGHTS)]
        else:  # FrozenDense: the compute dtype
            self.weights = [Buf(tape, n * tl.d.e, UNQUANTIZED_WEIGHTS)]
        # the LoRA layer's own A and B, replaced by views of the flat buffer
        self.init_ab: list[Buf] = []
        if lora:
            self.init_ab = [
                Buf(tape, tl.d.r * in_f * 4, LORA_PARAMS),
                Buf(tape, out_f * tl.d.r * 4, LORA_PARAMS),
            ]

    def _base_operand(self) -> None:
        """W for a product with the base: an NF4 base dequantized whole to the compute dtype
        (the GPU's 16-bit products take W whole) and dropped after the GEMM; a LoRA layer's
        dense base cast once to the compute dtype and kept."""
        tl = self.tl
        if tl.s.quant == "nf4":
            Buf(tl.tape, self.out_f * self.in_f * tl.d.e)
        elif self.lora and tl.d.e != 4 and self.cast is None:
            self.cast = Buf(tl.tape, self.out_f * self.in_f * tl.d.e, UNQUANTIZED_WEIGHTS)

    def _base_product(self, cols: int) -> Buf:
        """A frozen projection's x Wᵀ or dy W: the product, then its operand."""
        y = Buf(self.tl.tape, self.tl.d.tokens * cols * self.tl.d.e)
        self._base_operand()
        return y

    def forward(self, x: Buf) -> Buf:
        tl, d, n = self.tl, self.tl.d, self.tl.d.tokens
        if not self.lora:
            return self._base_product(self.out_f)
        keep = tl.keep_mask(n * self.in_f) if d.dropout else None
        xd = x if keep is None else Buf(tl.tape, n * self.in_f * d.e)
        h = Buf(tl.tape, n * d.r * d.e)
        if not self.slots:
            self.slots.append(Buf(tl.tape, SCALAR, RUNTIME_OVERHEAD))
        y = Buf(tl.tape, n * self.out_f * d.e)  # s·h·Bᵀ, then the base adds itself in
        self._base_operand()
        self.cache = {"xd": xd, "h": h, "keep": keep}
        return y

    def backward(self, dy: Buf) -> Buf:
        tl, d, n = self.tl, self.tl.d, self.tl.d.tokens
        if not self.lora:
            return self._base_product(self.in_f)
        assert self.cache is not None
        self.grad_b = Buf(tl.tape, self.out_f * d.r * 4, GRADIENTS)
        gh = Buf(tl.tape, n * d.r * d.e)
        if len(self.slots) < 2:
            self.slots.append(Buf(tl.tape, SCALAR, RUNTIME_OVERHEAD))
        self.grad_a = Buf(tl.tape, d.r * self.in_f * 4, GRADIENTS)
        dx = Buf(tl.tape, n * self.in_f * d.e)
        self._base_operand()
        del gh
        return dx

    def release(self) -> None:
        self.cache = None


class _Saved:
    """train/model.py's _Saved: what a layer's backward needs, in its field order."""

    def __init__(self, **fields: Any) -> None:
        self.fields = fields


class _Layer:
    def __init__(self, tl: NybbleTimeline) -> None:
        a, tape = tl.s.arch, tl.tape
        self.tl = tl
        norms = [a.hidden_size] + ([a.head_dim, a.head_dim] if a.qk_norm else []) + [a.hidden_size]
        self.norms = [Buf(tape, size * 4, UNQUANTIZED_WEIGHTS) for size in norms]
        shapes = a.linear_shapes(0)
        self.proj = {
            name: _Projection(tl, *shapes[name], lora=name in tl.s.targets) for name in PROJECTIONS
        }

    def forward(self, x: Buf, keep: bool) -> tuple[Buf, _Saved | None]:
        tl, a, d = self.tl, self.tl.s.arch, self.tl.d
        n, e, tape, p = d.tokens, d.e, tl.tape, self.proj
        x2 = x.view()
        n1, rstd_in = tl.norm(x2, a.hidden_size)
        q = p["q_proj"].forward(n1)
        k = p["k_proj"].forward(n1)
        v = p["v_proj"].forward(n1)
        del n1
        tl.rope()
        qt, rstd_q = tl.heads(a.num_heads)
        kt, rstd_k = tl.heads(a.num_kv_heads)
        vt = Buf(tape, n * a.kv_dim * e)
        q_raw, k_raw = (q, k) if a.qk_norm else (None, None)
        del q, k, v
        attn, lse = tl.attention_forward()
        h = tl.add(x2, p["o_proj"].forward(attn), a.hidden_size)
        n2, rstd_post = tl.norm(h, a.hidden_size)
        gate = p["gate_proj"].forward(n2)
        up = p["up_proj"].forward(n2)
        del n2
        y = tl.add(h, p["down_proj"].forward(Buf(tape, n * a.intermediate_size * e)), a.hidden_size)
        if not keep:
            for proj in p.values():
                proj.release()
            return y, None
        saved = _Saved(
            x=x2,
            rstd_in=rstd_in,
            q_raw=q_raw,
            rstd_q=rstd_q,
            k_raw=k_raw,
            rstd_k=rstd_k,
            q=qt,
            k=kt,
            v=vt,
            attn=attn,
            lse=lse,
            h=h,
            rstd_post=rstd_post,
            gate=gate,
            up=up,
        )
        return y, saved

    def backward(self, dy: Buf, s: _Saved) -> Buf:
        tl, a = self.tl, self.tl.s.arch
        p = self.proj
        dy2 = dy.view()
        da = p["down_proj"].backward(dy2)
        del da  # the gate's backward writes its gradients over the saved gate and up
        dn2 = p["gate_proj"].backward(s.fields["gate"])
        tl.accumulate(p["up_proj"].backward(s.fields["up"]))
        dh = tl.norm_backward(a.hidden_size)
        do = p["o_proj"].backward(dh)
        dq, dk, dv = tl.attention_backward()
        del do
        dq = tl.heads_backward(a.num_heads)
        dk = tl.heads_backward(a.num_kv_heads)
        dn1 = p["q_proj"].backward(dq)
        tl.accumulate(p["k_proj"].backward(dk))
        tl.accumulate(p["v_proj"].backward(dv))
        del dq, dk, dv
        dx = tl.norm_backward(a.hidden_size)
        for proj in p.values():
            proj.release()
        del dy2, dn2, dh, dn1
        return dx


class NybbleTimeline:
    """The event sequence of `Trainer(...).train_batch` steps for one setup."""

    def __init__(self, s: TrainingSetup) -> None:
        supported(s)
        check_replay_size(s)
        self.s, self.tape = s, Tape()
        self.d = _Dims(
            tokens=s.tokens,
            batch=s.batch,
            seq=s.seq_len,
            e=FLOAT_FORMATS[s.compute_dtype],
            r=s.lora_r,
            dropout=s.lora_dropout > 0,
        )
        self.steps_done = 0
        self._rope: list[Buf] = []

    # --- setup: DecoderLM._build, _make_flat, AdamW ----------------------------------------

    def setup(self) -> None:
        s, a, tape = self.s, self.s.arch, self.tape
        tape.tag = UNQUANTIZED_WEIGHTS
        self.embed = Buf(tape, a.vocab_size * a.hidden_size * self.d.e)
        self.layers = [_Layer(self) for _ in range(a.num_layers)]
        self.final_norm = Buf(tape, a.hidden_size * 4)
        self.head = None
        if not a.tie_word_embeddings:
            self.head = Buf(tape, a.vocab_size * a.hidden_size * self.d.e)
        # the trainable parameters in the flat buffer's order: layer by layer, A then B
        sizes = [
            size
            for layer in self.layers
            for proj in layer.proj.values()
            if proj.lora
            for size in (s.lora_r * proj.in_f, proj.out_f * s.lora_r)
        ]
        self.params = sum(sizes)
        self.flat = Buf(tape, self.params * 4, LORA_PARAMS)
        self.flat_grad = Buf(tape, self.params * 4, GRADIENTS)
        for size in sizes:
            Buf(tape, size * 4, LORA_PARAMS)  # each parameter's upload into its view
        for layer in self.layers:
            for proj in layer.proj.values():
                proj.init_ab.clear()
        tape.tag = OPTIMIZER_STATES
        self.states = [Buf(tape, self.params * 4) for _ in ("m", "v", "accumulated")]
        tape.tag = ACTIVATIONS

    # --- the pieces ----------------------------------------------------------------------

    def rope(self) -> None:
        """cos and sin [T, head_dim], made at the first forward of a length and kept."""
        if not self._rope:
            size = self.d.seq * self.s.arch.head_dim * self.d.e
            self._rope = [Buf(self.tape, size, UNQUANTIZED_WEIGHTS) for _ in "cs"]

    def norm(self, x: Buf, width: int) -> tuple[Buf, Buf]:
        n = self.d.tokens
        return Buf(self.tape, n * width * self.d.e), Buf(self.tape, n * 4)

    def norm_backward(self, width: int) -> Buf:
        return Buf(self.tape, self.d.tokens * width * self.d.e)

    def heads(self, heads: int) -> tuple[Buf, Buf | None]:
        a, n = self.s.arch, self.d.tokens
        out = Buf(self.tape, n * heads * a.head_dim * self.d.e)
        return out, (Buf(self.tape, n * heads * 4) if a.qk_norm else None)

    def heads_backward(self, heads: int) -> Buf:
        return Buf(self.tape, self.d.tokens * heads * self.s.arch.head_dim * self.d.e)

    def add(self, x: Buf, y: Buf, width: int) -> Buf:
        return Buf(self.tape, self.d.tokens * width * self.d.e)

    def accumulate(self, y: Buf) -> None:
        """`a += y`: y is dropped after."""

    def keep_mask(self, elems: int) -> Buf:
        """lora/dropout.py: a uint32 hash of every element's index, compared and cast."""
        z = Buf(self.tape, elems * 4)
        Buf(self.tape, elems * 4)  # the shifts' temporaries
        below = Buf(self.tape, elems)
        keep = Buf(self.tape, elems * self.d.e)
        del below, z
        return keep

    def _chunks(self, group: int) -> Iterator[tuple[int, int]]:
        a, d = self.s.arch, self.d
        nb = d.batch * a.num_kv_heads
        per_position = max(1, nb * group * d.seq)
        step = max(1, min(d.seq, ATTENTION_CHUNK_ELEMENTS // per_position))
        for t0 in range(0, d.seq, step):
            yield t0, min(t0 + step, d.seq)

    def attention_forward(self) -> tuple[Buf, Buf]:
        a, d, tape = self.s.arch, self.d, self.tape
        nb, group, e = d.batch * a.num_kv_heads, a.num_heads // a.num_kv_heads, d.e
        out = Buf(tape, d.tokens * a.q_dim * e)
        lse = Buf(tape, d.tokens * a.num_heads * 4)
        for t0, t1 in self._chunks(group):
            rows = (t1 - t0) * group
            s = Buf(tape, nb * rows * t1 * e)
            oc = Buf(tape, nb * rows * a.head_dim * e)
        del s, oc
        return out, lse

    def attention_backward(self) -> tuple[Buf, Buf, Buf]:
        a, d, tape = self.s.arch, self.d, self.tape
        nb, group, e, hd = d.batch * a.num_kv_heads, a.num_heads // a.num_kv_heads, d.e, a.head_dim
        n, qd = d.tokens, a.q_dim
        x1, x2 = Buf(tape, n * qd * 4), Buf(tape, n * qd * 4)  # do and out in float32
        prod = Buf(tape, n * qd * 4)
        del x1, x2
        delta = Buf(tape, n * a.num_heads * 4)
        del prod
        delta = Buf(tape, n * a.num_heads * 4)  # made contiguous
        dob = Buf(tape, n * qd * e)
        dq = Buf(tape, n * qd * e)
        dk = Buf(tape, n * a.kv_dim * 4)
        dv = Buf(tape, n * a.kv_dim * 4)
        for t0, t1 in self._chunks(group):
            rows = (t1 - t0) * group
            s = Buf(tape, nb * rows * t1 * e)
            dp = Buf(tape, nb * rows * t1 * e)
            for _ in "vk":  # dV += Pᵀ·dO, dK += dSᵀ·Q: the product, its float32 copy
                part = Buf(tape, nb * t1 * hd * e)
                wide = Buf(tape, nb * t1 * hd * 4)
                del part, wide
            dqc = Buf(tape, nb * rows * hd * e)
        dk_out = Buf(tape, n * a.kv_dim * e)
        dv_out = Buf(tape, n * a.kv_dim * e)
        del delta, dk, dv, dob, s, dp, dqc
        return dq, dk_out, dv_out

    def head_cross_entropy(self, grad: bool) -> Buf | None:
        """The loss a chunk of rows at a time; returns dL/dh (with `grad`)."""
        a, d, tape = self.s.arch, self.d, self.tape
        n, vocab, e = d.tokens, a.vocab_size, d.e
        tape.tag = LOGITS_LOSS
        total = Buf(tape, SCALAR)
        dh = Buf(tape, n * a.hidden_size * e) if grad else None
        step = max(1, min(n, HEAD_CHUNK_ELEMENTS // max(1, vocab)))
        # A chunk's arrays by name: each is dropped when the next chunk's of that name exists.
        live: dict[str, Buf] = {}
        for r0 in range(0, n, step):
            rows = min(step, n - r0)
            live["index"] = Buf(tape, rows * 8)
            live["valid"] = Buf(tape, rows)
            live["safe"] = Buf(tape, rows * 8)
            logits = Buf(tape, rows * vocab * e)
            lf = Buf(tape, rows * vocab * 4)
            del logits
            for name in ("max", "picked", "sums", "losses"):
                live[name] = Buf(tape, rows * 4)
            if not grad:
                live["lf"] = lf
                continue
            live["weight"] = Buf(tape, rows * 4)
            live["dlogits"] = Buf(tape, rows * vocab * e)
            del lf
            Buf(tape, rows * a.hidden_size * e)  # dh[r0:r1] = the product
        live.clear()
        del total
        tape.tag = ACTIVATIONS
        return dh

    # --- a training step ----------------------------------------------------------------

    def step(self) -> None:
        """One `Trainer.train_batch`."""
        a, d, tape = self.s.arch, self.d, self.tape
        self.steps_done += 1
        tape.step(self.steps_done)
        tape.phase("forward")
        ids = Buf(tape, d.tokens * 8, RUNTIME_OVERHEAD)
        targets = Buf(tape, d.tokens * 8, RUNTIME_OVERHEAD)
        flat16 = Buf(tape, self.params * d.e, LORA_PARAMS) if d.e != 4 else None
        x = Buf(tape, d.tokens * a.hidden_size * d.e)  # the embedding's rows
        inputs: list[Buf] = []
        saved: list[_Saved | None] = []
        checkpointing = self.s.grad_checkpointing
        for layer in self.layers:
            if checkpointing:
                inputs.append(x)
                x, _ = layer.forward(x, keep=False)
            else:
                x, s = layer.forward(x, keep=True)
                saved.append(s)
        tape.phase("loss")
        x2 = x.view()
        h, rstd = self.norm(x2, a.hidden_size)
        dh = self.head_cross_entropy(grad=True)
        del x, h
        tape.phase("backward")
        dx = self.norm_backward(a.hidden_size)
        del dh, x2
        for layer in reversed(self.layers):
            if checkpointing:
                _, s = layer.forward(inputs.pop(), keep=True)
            else:
                s = saved.pop()
            assert s is not None
            dx = layer.backward(dx, s)
            del s
        del rstd, dx
        del flat16
        tape.phase("optimizer")
        self.optimizer_step()
        del ids, targets

    def optimizer_step(self) -> None:
        """lora/optim.py's AdamW.step on the flat buffer: the gradient's norm, then the update's
        whole-buffer temporaries."""
        tape, size = self.tape, self.params * 4
        tape.tag = OPTIMIZER_STATES
        if not hasattr(self, "_finite_slot"):
            self._finite_slot = Buf(tape, SCALAR, RUNTIME_OVERHEAD)
        square = Buf(tape, size)
        norm = Buf(tape, SCALAR)
        del square
        g = Buf(tape, size)
        Buf(tape, size)  # (1 - b1)·g
        t1, t2 = Buf(tape, size), Buf(tape, size)  # (1 - b2)·g, ·g
        del t1, t2
        m_hat = Buf(tape, size)
        lr_m = Buf(tape, size)
        del m_hat
        v_hat = Buf(tape, size)
        root = Buf(tape, size)
        del v_hat
        denom = Buf(tape, size)
        del root
        Buf(tape, size)  # the update, subtracted from the parameters
        del lr_m, denom, norm, g
        tape.tag = ACTIVATIONS


__all__ = [
    "MAX_CHUNKS_PER_STEP",
    "Buf",
    "NybbleTimeline",
    "ReplayLimitError",
    "check_replay_size",
    "chunks_per_step",
    "supported",
]
