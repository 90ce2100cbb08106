"""The allocations of a transformers + PEFT + bitsandbytes QLoRA run, in order, for the
allocator simulation (`allocator`), each tagged with the breakdown part it belongs to (`parts`).

What the caching allocator keeps reserved depends on the order and sizes of every allocation
and free, not only on how much is alive at the peak. `PeftBnbTimeline` writes that order down
for one `TrainingSetup`: model load (transformers' allocator warm-up, then each weight loaded
in bf16 and quantized), `prepare_model_for_kbit_training` (float32 copies of the unquantized
weights, `empty_cache`), PEFT's adapters, then training steps (forward, loss, backward,
AdamW, `zero_grad`). Each op is written as the tensors it allocates and frees, as the
allocation traces of real runs (tests/fixtures/memory/traces) show them; tensors of a few
kilobytes that live for one op are left out. A ("step", n) event starts step n (peak counters
reset, as a measurement resets them) and ("phase", i) events name the part of the step that
follows (`Tape.phases[i]`).

Two training loops are written (`LOOPS`), which differ in what the allocator sees:
- "plain": the loop of docs/estimator.md: new input ids each step
  (`torch.randint(..., device="cuda")`, labels = the ids, no attention mask),
  `use_cache=False`;
- "benchmark": the step loop of benchmarks/memory/measure_peft_bnb.py, which the traces
  record: one batch made before training (ids, an all-ones attention mask, a copy of the ids
  as labels) and the config's `use_cache` (True), so without checkpointing transformers' KV
  cache keeps a copy of every layer's keys and values until the forward ends.

A `Recipe` gives the dtypes the run keeps (`Recipe.standard`, the recipe above, unless told:
nybble's torch layer and bitsandbytes under FSDP1 keep others, `distributed`). The hook
methods of a step (`_forward_begins`, `_layer_backward_ends`, ...) do nothing here: the
timeline of one GPU of a distributed run (`distributed`) writes FSDP's gathers and
reduce-scatters there, on streams of their own (`Tape.stream`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .arch import ATTENTION_PROJECTIONS, SHARED_EXPERT_GATE
from .parts import (
    ACTIVATIONS,
    GRADIENTS,
    LOAD,
    LOGITS_LOSS,
    LORA_PARAMS,
    OPTIMIZER_STATES,
    QUANT_CONSTANTS,
    QUANTIZED_WEIGHTS,
    RUNTIME_OVERHEAD,
    UNQUANTIZED_WEIGHTS,
)
from .quant import FLOAT_FORMATS, stored_weight
from .setup import LOOPS, TrainingSetup, optimizer_states, optimizer_temporaries

Event = tuple[str, int, int]

#: cuBLAS workspace per (handle, stream) with torch >= 2.3 on Hopper, taken from the caching
#: allocator at a thread's first matmul: the forward thread and the autograd thread each get one.
CUBLAS_WORKSPACE = 32 << 20


class Tape:
    """Allocations and frees as `replay` events; tensors are named by increasing keys, and
    `tags[key]` is the breakdown part of each (`tag` unless given)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.tags: dict[int, str] = {}
        self.phases: list[str] = []
        self.tag = ACTIVATIONS
        self._key = 0

    def new(self, nbytes: int, tag: str | None = None) -> int:
        self._key += 1
        self.events.append(("alloc", self._key, max(int(nbytes), 1)))
        self.tags[self._key] = tag or self.tag
        return self._key

    def free(self, *keys: int | None) -> None:
        for key in keys:
            if key is not None:
                self.events.append(("free", key, 0))

    def alloc(self, nbytes: int) -> int:
        """An allocation tagged with the current `tag` (a recording backend's Recorder)."""
        return self.new(nbytes)

    def temp(self, nbytes: int, tag: str | None = None) -> None:
        """A tensor that dies right after the op that made it."""
        self.free(self.new(nbytes, tag))

    def mark(self, event: str) -> None:
        self.events.append((event, 0, 0))

    def phase(self, name: str) -> None:
        """What follows belongs to the part of the step called `name`."""
        if name not in self.phases:
            self.phases.append(name)
        self.events.append(("phase", self.phases.index(name), 0))

    def step(self, number: int) -> None:
        """Training step `number` (1, 2, ...) starts; peak counters are reset."""
        self.events.append(("step", number, 0))

    def stream(self, number: int) -> None:
        """What follows is allocated on stream `number` (0, the default, unless told)."""
        self.events.append(("stream", number, 0))


@dataclass(frozen=True)
class Recipe:
    """The dtypes a run keeps, in bytes an element: the unquantized weights as loaded
    (`load`), whether `prepare_model_for_kbit_training` replaces them with float32 copies
    (`upcast`), the residual stream (`residual`), the LoRA parameters as stored (`lora`) and as
    computed with (`lora_compute`: FSDP2's mixed precision gathers them in the compute dtype).
    `cast_logits`: the head's logits come out in the residual's dtype and the loss casts them to
    float32 (a run without the up-cast); the standard recipe's are float32 already."""

    load: int
    upcast: bool
    residual: int
    lora: int
    lora_compute: int
    cast_logits: bool = False

    @classmethod
    def standard(cls, s: TrainingSetup) -> Recipe:
        """The single-GPU recipe of docs/estimator.md: a 4-bit base loaded in bf16, its other
        weights made float32 by prepare_model_for_kbit_training (so the residual stream is
        float32); a float base kept as it is; the LoRA parameters in `lora_dtype`."""
        lb = FLOAT_FORMATS[s.lora_dtype]
        if s.quantized:
            return cls(load=2, upcast=True, residual=4, lora=lb, lora_compute=lb)
        width = FLOAT_FORMATS[s.quant]
        return cls(load=width, upcast=False, residual=width, lora=lb, lora_compute=lb)

    @property
    def unquantized(self) -> int:
        """Bytes of an unquantized weight in training."""
        return 4 if self.upcast else self.load


class _Saved:
    """What one layer keeps for backward; under no_grad (checkpointed forward) nothing."""

    def __init__(self, tape: Tape, grad: bool) -> None:
        self.tape, self.grad = tape, grad
        self.keys: dict[str, int] = {}

    def put(self, name: str, key: int | None) -> None:
        if key is None:
            return
        if self.grad:
            if name in self.keys:  # two tensors under one name: one would never be freed
                raise AssertionError(f"saved tensor {name!r} written twice")
            self.keys[name] = key
        else:
            self.tape.free(key)

    def pop(self, name: str) -> int | None:
        return self.keys.pop(name, None)


class PeftBnbTimeline:
    """The event sequence of the protocol's recipe for one setup (see the module docstring)."""

    def __init__(self, s: TrainingSetup, loop: str = "plain", recipe: Recipe | None = None) -> None:
        if loop not in LOOPS:
            raise ValueError(f"unknown training loop {loop!r} (known: {', '.join(LOOPS)})")
        a = s.arch
        self.s, self.a, self.tape = s, a, Tape()
        self.loop = loop
        # transformers' KV cache during training forwards: the config's use_cache (True) in
        # the benchmark loop, off in the plain loop; checkpointing turns it off either way
        self.use_cache = loop == "benchmark" and not s.grad_checkpointing
        self.steps_done = 0
        self.input_ids: int | None = None
        self.t = s.tokens
        self.recipe = recipe if recipe is not None else Recipe.standard(s)
        self.e = self.recipe.residual  # residual stream bytes
        self.lb = self.recipe.lora_compute  # the LoRA branch's tensors and its gradients
        self.lp = self.recipe.lora  # the LoRA parameters and their optimizer states
        self.shapes = a.linear_shapes()
        self.targets = set(s.targets)
        self.math = self.e == 4 and a.is_gqa  # SDPA's math backend (see PeftBnb)
        self.lora_grads: list[int] = []
        self.workspaces: list[int] = []

    # --- setup ----------------------------------------------------------------------

    def setup(self) -> None:
        s, a, tp = self.s, self.a, self.tape
        up = self.recipe.load
        load = 2 * (a.embedding_params + a.lm_head_params + a.hidden_size)
        for layer in range(a.num_layers):
            load += 2 * (sum(a.norm_sizes()) + sum(a.linear_biases(layer).values()))
            for out_f, in_f in a.linear_shapes(layer).values():
                n = out_f * in_f
                load += n // 2 if s.quantized else n * up
            if a.is_sparse(layer):
                load += 2 * sum(e * o * i for e, o, i in a.expert_shapes().values())
        # transformers reserves the whole checkpoint in one block before loading into it
        tp.temp(load, LOAD)
        # (what is never freed stays allocated: the weights, the adapters, the inputs)
        # (in name order: lm_head.weight before model.embed_tokens.weight)
        tp.tag = UNQUANTIZED_WEIGHTS
        head = tp.new(2 * a.lm_head_params) if a.lm_head_params else None
        embed = tp.new(2 * a.embedding_params)
        norms = [[tp.new(2 * n) for n in a.norm_sizes()] for _ in range(a.num_layers)]
        # transformers 5's fused experts and the router, per sparse layer: bf16 parameters,
        # not quantized (memory.arch)
        experts: list[dict[str, int]] = []
        for layer in range(a.num_layers):
            loaded: dict[str, int] = {}
            if a.is_sparse(layer):  # by name: experts.down_proj, experts.gate_up_proj, gate
                for name in ("down_proj", "gate_up_proj", "router"):
                    e, o, i = a.expert_shapes()[name]
                    loaded[name] = tp.new(2 * e * o * i)
            experts.append(loaded)
            # a layer's weights load in the order of their names: mlp.* before self_attn.*
            # (a shared expert's mlp.shared_expert.* before mlp.shared_expert_gate)
            shapes = a.linear_shapes(layer)
            for name in sorted(
                shapes,
                key=lambda p: (
                    "self_attn" if p in ATTENTION_PROJECTIONS else "mlp",
                    p == SHARED_EXPERT_GATE,
                    p,
                ),
            ):
                out_f, in_f = shapes[name]
                self._load_linear(out_f * in_f, up)
        final = tp.new(2 * a.hidden_size)
        # prepare_model_for_kbit_training: float32 copies of every unquantized parameter, in
        # the order of model.parameters(): the embeddings, then layer by layer (the attention's
        # q/k norms, the MLP's router and experts, the two norms), the final norm, lm_head
        if self.recipe.upcast:
            self._upcast(embed, a.embedding_params)
            sizes = a.norm_sizes()
            shapes3 = a.expert_shapes()
            for layer in range(a.num_layers):
                for j in range(2, len(sizes)):  # q_norm, k_norm
                    self._upcast(norms[layer][j], sizes[j])
                for name in self._moe_param_order():
                    if name in experts[layer]:
                        e, o, i = shapes3[name]
                        self._upcast(experts[layer][name], e * o * i)
                for j in range(2):  # input_layernorm, post_attention_layernorm
                    self._upcast(norms[layer][j], sizes[j])
            self._upcast(final, a.hidden_size)
            if head:
                self._upcast(head, a.lm_head_params)
            tp.mark("empty_cache")
        # PEFT: A and B of every target, float32 unless told otherwise; the linear layers
        # first, then the expert parameters (`lora.ParamWrapper`, a second pass)
        for n in self._lora_setup_order():
            tp.new(self.lp * n, LORA_PARAMS)
        tp.tag = ACTIVATIONS
        if self.loop == "benchmark":
            for _ in range(3):  # input_ids, attention_mask, labels: made once, kept
                tp.new(8 * self.t)

    def _moe_param_order(self) -> tuple[str, ...]:
        """A sparse layer's router and experts in the order the module registers them."""
        if self.a.model_type == "qwen3_moe":
            return ("gate_up_proj", "down_proj", "router")
        return ("router", "gate_up_proj", "down_proj")

    def _lora_setup_order(self) -> list[int]:
        """Element counts of the LoRA tensors in the order PEFT makes them: every targeted
        linear layer, layer by layer, then every targeted expert parameter."""
        s = self.s
        linear: list[int] = []
        experts: list[int] = []
        for layer in range(self.a.num_layers):
            shapes = self.a.linear_shapes(layer)
            for t in s.targets:
                if t in shapes:
                    out_f, in_f = shapes[t]
                    linear += [s.lora_r * in_f, out_f * s.lora_r]
            if s.expert_targets and self.a.is_sparse(layer):
                for name in s.expert_order():
                    experts += s.expert_lora_tensors(name)
        return linear + experts

    def _load_linear(self, n: int, up: int) -> None:
        s, tp = self.s, self.tape
        if not s.quantized:
            tp.new(n * up, UNQUANTIZED_WEIGHTS)
            return
        bf16 = tp.new(2 * n, LOAD)
        w = stored_weight(n, s.quant, s.blocksize, s.double_quant)
        absmax = tp.new(4 * w.nblocks, LOAD)
        tp.new(w.codes, QUANTIZED_WEIGHTS)
        if s.double_quant:
            # the float absmax is quantized again: uint8 codes, nested float32 absmax
            tp.temp(4 * w.nblocks, LOAD)
            tp.new(w.nblocks, QUANT_CONSTANTS)
            tp.new(4 * w.nested_blocks, QUANT_CONSTANTS)
        else:
            tp.new(4 * w.nblocks, QUANT_CONSTANTS)
        tp.free(absmax, bf16)

    def _upcast(self, key: int | None, n: int) -> None:
        self.tape.new(4 * n, UNQUANTIZED_WEIGHTS)  # the float32 copy, kept
        self.tape.free(key)

    # --- forward ops -----------------------------------------------------------------

    def _rmsnorm(self, x: int, width: int, rows: int, saved: _Saved, tag: str) -> int:
        """Llama/Qwen RMSNorm of a float32 input: saves its rsqrt (and needs its input)."""
        tp, e = self.tape, self.e
        tp.temp(4 * rows * width)  # x.pow(2)
        mean = tp.new(4 * rows)
        tp.temp(4 * rows)  # + eps
        rsqrt = tp.new(4 * rows)
        normed = tp.new(4 * rows * width)
        out = tp.new(e * rows * width)  # weight * normed
        tp.free(normed, mean)
        saved.put(tag, rsqrt)
        return out

    def _linear(self, x: int, name: str, saved: _Saved) -> int:
        """A bitsandbytes 4-bit linear (weight dequantized to bf16 per call) with PEFT's LoRA."""
        s, tp, t, e, lb = self.s, self.tape, self.t, self.e, self.lb
        out_f, in_f = self.shapes[name]
        if s.quantized:
            w = stored_weight(out_f * in_f, s.quant, s.blocksize, s.double_quant)
            xb = tp.new(2 * t * in_f) if e != 2 else None
            scales = [tp.new(4 * w.nblocks) for _ in range(2 if s.double_quant else 1)]
            wb = tp.new(2 * out_f * in_f)
            ob = tp.new(2 * t * out_f)
            tp.free(*reversed(scales))
            tp.free(wb)
            out = tp.new(e * t * out_f) if e != 2 else ob
            if e != 2:
                tp.free(ob)
            tp.free(xb)
        else:
            out = tp.new(e * t * out_f)
        if name not in self.targets:
            return out
        res = tp.new(e * t * out_f)  # PEFT adds into a copy of the base output
        tp.free(out)
        lora_in = None
        if s.lora_dropout > 0:
            lora_in = tp.new(lb * t * in_f)
            saved.put(name + ".mask", tp.new(t * in_f))
        elif lb != e:
            lora_in = tp.new(lb * t * in_f)
        saved.put(name + ".in", lora_in)
        a_out = tp.new(lb * t * s.lora_r)
        bo = tp.new(lb * t * out_f)
        saved.put(name + ".a", a_out)  # (dies here under no_grad)
        scaled = tp.new(e * t * out_f)
        tp.free(bo)
        total = tp.new(e * t * out_f)
        tp.free(res, scaled)
        return total

    def _workspace(self, thread: int) -> None:
        """A thread's cuBLAS workspace, taken at its first matmul and kept."""
        if len(self.workspaces) == thread:
            self.workspaces.append(self.tape.new(CUBLAS_WORKSPACE, RUNTIME_OVERHEAD))

    def _rope(self, x: int, width: int) -> int:
        """q * cos + rotate_half(q) * sin."""
        tp, t = self.tape, self.t
        xc = tp.new(4 * t * width)
        half = tp.new(2 * t * width)
        cat = tp.new(4 * t * width)
        tp.free(half)
        xs = tp.new(4 * t * width)
        tp.free(cat)
        out = tp.new(4 * t * width)
        tp.free(xc, xs)
        return out

    def layer_forward(self, x: int, layer: int, grad: bool) -> tuple[int, _Saved]:
        """One decoder layer; `x` (the residual stream) stays alive. Returns its output."""
        s, a, tp, t, e = self.s, self.a, self.tape, self.t, self.e
        self.shapes = a.linear_shapes(layer)
        sv = _Saved(tp, grad)
        qd, kvd = a.q_dim, a.kv_dim
        # layer 0's input needs no gradient without checkpointing: its norm saves nothing
        norm_sv = sv if (layer > 0 or s.grad_checkpointing) else _Saved(tp, False)
        xn = self._rmsnorm(x, a.hidden_size, t, norm_sv, "norm1")
        # q_norm(q_proj(x)), k_norm(k_proj(x)), v_proj(x), in that order
        q = self._linear(xn, "q_proj", sv)
        if a.qk_norm:
            qn = self._rmsnorm(q, a.head_dim, t * a.num_heads, sv, "qnorm")
            sv.put("q", q)
            q = qn
        k = self._linear(xn, "k_proj", sv)
        if a.qk_norm:
            kn = self._rmsnorm(k, a.head_dim, t * a.num_kv_heads, sv, "knorm")
            sv.put("k", k)
            k = kn
        v: int | None = self._linear(xn, "v_proj", sv)
        qe = self._rope(q, qd)
        ke: int | None = self._rope(k, kvd)
        tp.free(q, k)
        if self.use_cache:
            # transformers' DynamicCache keeps copies of k and v until the forward ends; the
            # attention goes on with the copies and the originals die
            ck, cv = tp.new(4 * t * kvd), tp.new(4 * t * kvd)
            tp.free(ke, v)
            if self.math:
                self.cache += [ck, cv]
                ke = v = None
            else:
                ke, v = ck, cv  # saved by the fused kernel
        # Each put below is the tensor's last use: freed there under no_grad (the checkpointed
        # forward), kept for backward otherwise. Python's own references (the attention
        # function's q, k, v; the layer's normed input) last until the attention returns.
        if self.math:
            s2 = 4 * s.batch * a.num_heads * s.seq_len * s.seq_len
            qs = tp.new(4 * t * qd)  # q * scale
            # the causal mask: two boolean seq x seq tensors, then as float
            bools = tp.new(s.seq_len * s.seq_len), tp.new(s.seq_len * s.seq_len)
            tp.free(bools[0])
            mask = tp.new(4 * s.seq_len * s.seq_len)
            tp.free(bools[1])
            kr, vr = tp.new(4 * t * qd), tp.new(4 * t * qd)  # k, v repeated to every head
            kt = tp.new(4 * t * qd)  # k^T * scale
            # with several sequences q * scale is copied for the batched matmul, and the copy
            # is what backward keeps
            copy = tp.new(4 * t * qd) if s.batch > 1 else None
            scores = tp.new(s2)
            if copy is not None and grad:
                qs, copy = copy, qs
            elif copy is not None:
                tp.free(copy)
                copy = None
            sv.put("kt", kt)
            probs = tp.new(s2)
            tp.temp(s2 // 4)  # the boolean "row fully masked" test of the safe softmax
            tp.free(scores)
            o = tp.new(4 * t * qd)
            sv.put("vr", vr)
            sv.put("qs", qs)
            tp.free(kr, copy, mask)
            sv.put("probs", probs)
            oc = tp.new(e * t * qd)  # transpose(1, 2).contiguous()
            tp.free(o)
        else:
            # the fused kernels save q, k, v, their output and its logsumexp; their output is
            # token-major already, so o_proj takes it as it is
            oc = tp.new(e * t * qd)
            lse = tp.new(4 * s.batch * a.num_heads * (-(-s.seq_len // 32) * 32))
            sv.put("lse", lse)
        attn = self._linear(oc, "o_proj", sv)
        sv.put("o" if not self.math else "oc", oc)
        if self.math:
            tp.free(qe, ke, v)
        else:
            for name, key in (("qe", qe), ("ke", ke), ("v", v)):
                sv.put(name, key)
        sv.put("xn", xn)
        x1 = tp.new(e * t * a.hidden_size)
        tp.free(attn)
        xn2 = self._rmsnorm(x1, a.hidden_size, t, sv, "norm2")
        if a.is_sparse(layer):
            down = self._moe_forward(xn2, sv)
        else:
            down = self._mlp_forward(xn2, sv, a.intermediate_size)
        sv.put("xn2", xn2)  # the layer's own reference lasts until the MLP returns
        out = tp.new(e * t * a.hidden_size)
        tp.free(down)
        sv.put("x1", x1)
        return out, sv

    def _mlp_forward(self, xn2: int, sv: _Saved, inter: int) -> int:
        """down_proj(act_fn(gate_proj(x)) * up_proj(x)), evaluated in that order."""
        tp, t, e = self.tape, self.t, self.e
        gate = self._linear(xn2, "gate_proj", sv)
        act = tp.new(e * t * inter)
        sv.put("gate", gate)
        upo = self._linear(xn2, "up_proj", sv)
        prod = tp.new(e * t * inter)
        sv.put("act", act)
        sv.put("up", upo)
        down = self._linear(prod, "down_proj", sv)
        sv.put("prod", prod)
        return down

    def _moe_forward(self, x: int, sv: _Saved) -> int:
        """A mixture-of-experts MLP as transformers 5.17 runs it (MixtralSparseMoeBlock,
        Qwen2MoeSparseMoeBlock, Qwen3MoeSparseMoeBlock): the shared expert, the router
        (float32 logits, softmax, top-k, the weights normalised in place), the experts
        (`_experts_forward`), the shared expert's sigmoid gate. Written from the code of
        transformers 5.17 and PEFT 0.21 and checked against measured peaks, not traces
        (docs/estimator.md)."""
        a, tp, t, e = self.a, self.tape, self.t, self.e
        h, n_exp, k = a.hidden_size, a.num_experts, a.experts_per_token
        shared = None
        if a.shared_expert_intermediate_size:
            shared = self._mlp_forward(x, sv, a.shared_expert_intermediate_size)
        router_w = self._router_weight() if self.s.expert_targets else None
        logits = tp.new(4 * t * n_exp)
        probs = tp.new(4 * t * n_exp)  # softmax keeps its output for backward
        weights, index = tp.new(4 * t * k), tp.new(8 * t * k)
        tp.temp(4 * t)  # the weights' sum; they are divided by it in place
        tp.free(logits)  # returned by the router, dropped by the block
        sv.put("router.probs", probs)
        sv.put("router.topk", index)
        sv.put("router.w", router_w)  # the linear keeps the adapted weight for backward
        final = self._experts_forward(x, sv)
        tp.free(weights)  # the block's reference; backward needs its indexed copy only
        if shared is None:
            return final
        gate = self._linear(x, SHARED_EXPERT_GATE, sv)  # one output per token
        sig = tp.new(e * t)  # sigmoid keeps its output for backward
        tp.free(gate)
        gated = tp.new(e * t * h)
        sv.put("shared.sig", sig)
        sv.put("shared.out", shared)
        total = tp.new(e * t * h)
        tp.free(final, gated)
        return total

    def _experts_forward(self, x: int, sv: _Saved) -> int:
        """transformers 5's default experts implementation, `grouped_mm`
        (integrations/moe.py): the token-expert pairs sorted by expert, the tokens gathered in
        that order, one grouped matmul for every expert's gate and up projections (float32
        weights: torch runs the grouped matmul as one mm per expert into one output), silu *
        up, one for the down projection, times the routing weights, put back in token order
        and summed over each token's experts. With PEFT's adapter on the experts
        (`TrainingSetup.expert_targets`) each fused weight is replaced for the forward by
        W + scaling * B A, a new tensor the size of the whole expert stack
        (`_expert_weight`), which the grouped matmul keeps for backward."""
        a, tp, t, e = self.a, self.tape, self.t, self.e
        h, i = a.hidden_size, a.expert_intermediate_size
        pairs = t * a.experts_per_token
        adapted = bool(self.s.expert_targets)
        ids, perm = tp.new(8 * pairs), tp.new(8 * pairs)  # torch.sort of the chosen experts
        rows = tp.new(8 * pairs)  # perm // top_k
        sel = tp.new(e * pairs * h)  # hidden_states[perm // top_k]
        sv.put("moe.rows", rows)
        sw = tp.new(4 * pairs)  # the routing weights in the same order
        tp.temp(4 * pairs)  # the expert ids as int32 for histc
        mask = tp.new(pairs)  # no pair is an expert-parallel sentinel here; the mask is made
        w_gu = self._expert_weight("gate_up_proj") if adapted else None
        gu = tp.new(e * pairs * 2 * i)
        gum = tp.new(e * pairs * 2 * i)  # masked_fill: the grouped matmul's output dies
        tp.free(gu)
        act = tp.new(e * pairs * i)  # silu(gate)
        prod = tp.new(e * pairs * i)  # * up
        sv.put("moe.act", act)
        sv.put("moe.gum", gum)  # silu and the product keep views of it
        w_dn = self._expert_weight("down_proj") if adapted else None
        dn = tp.new(e * pairs * h)
        if adapted:  # the grouped matmul keeps its input for the weight's gradient
            sv.put("moe.prod", prod)
        else:
            tp.free(prod)
        dnm = tp.new(e * pairs * h)  # masked_fill
        tp.free(dn)
        weighted = tp.new(e * pairs * h)  # * routing weights
        inv = tp.new(8 * pairs)  # the inverse permutation, from an arange
        tp.temp(8 * pairs)
        ordered = tp.new(e * pairs * h)  # weighted[inv_perm]
        tp.free(weighted)
        final = tp.new(e * t * h)  # .sum over each token's experts
        # the function returns: its locals die unless autograd keeps them
        tp.free(ids, ordered)
        for name, key in (("perm", perm), ("sw", sw), ("dnm", dnm), ("inv", inv), ("mask", mask)):
            sv.put("moe." + name, key)
        if adapted:
            sv.put("moe.sel", sel)
        else:
            tp.free(sel)
        # parametrize's cache ends with PEFT's wrapper: W + B A lives on as a saved tensor
        sv.put("moe.w_gu", w_gu)
        sv.put("moe.w_dn", w_dn)
        return final

    def _expert_weight(self, name: str) -> int:
        """PEFT's `lora.ParamWrapper` (one adapter, float32 weight): for the forward the fused
        parameter becomes `baddbmm(W, B, A, alpha=scaling)`, a new tensor of its full size;
        B's view (experts x out x rank, permuted) is copied contiguous for the batched
        matmul."""
        experts, out_f, in_f = self.a.expert_shapes()[name]
        rank = self.s.expert_rank(name)
        w = self.tape.new(self.e * experts * out_f * in_f)
        self.tape.temp(self.lb * experts * out_f * rank)
        return w

    def _router_weight(self) -> int:
        """The adapted router weight for its forward: W + (B @ A) * scaling (experts x
        hidden; a 2-D parameter, so PEFT builds the delta and adds it)."""
        tp, n = self.tape, self.a.num_experts * self.a.hidden_size
        delta = tp.new(self.lb * n)
        w = tp.new(self.e * n)
        tp.free(delta)
        return w

    def _mlp_backward(self, g: int, sv: _Saved, inter: int, into: int | None = None) -> int:
        """The gated MLP's backward, in autograd's order: down_proj, the product, up_proj,
        silu, gate_proj; returns the gradient of its input (or adds it into `into`)."""
        tp, t = self.tape, self.t
        gp = self._linear_backward(g, "down_proj", sv, last_of="prod", free_g=False)
        gup, gact = tp.new(4 * t * inter), tp.new(4 * t * inter)
        tp.free(gp, sv.pop("up"), sv.pop("act"))
        if into is not None:
            self._linear_backward(gup, "up_proj", sv, into=into)
            gu = into
        else:
            gu = self._linear_backward(gup, "up_proj", sv)
        ggate = tp.new(4 * t * inter)
        tp.free(gact, sv.pop("gate"))
        return self._linear_backward(ggate, "gate_proj", sv, last_of="xn2", into=gu)

    def _moe_backward(self, g: int, sv: _Saved) -> int:
        """The mixture of experts' backward in autograd's order (the nodes made last run
        first): the shared expert's sigmoid gate, the experts (`_experts_backward`), the router
        (top-k, softmax, its linear), then the shared expert's MLP. The input's gradient is
        the first branch's; the others are added into it."""
        a, tp, t, e = self.a, self.tape, self.t, self.e
        h, n_exp = a.hidden_size, a.num_experts
        gx: int | None = None
        gshared = None
        if a.shared_expert_intermediate_size:
            gshared = tp.new(e * t * h)  # g * sigmoid(gate), waiting for the shared MLP
            gsig = tp.new(4 * t)
            tp.free(sv.pop("shared.sig"), sv.pop("shared.out"))
            ggate = tp.new(4 * t)
            tp.free(gsig)
            gx = self._linear_backward(ggate, SHARED_EXPERT_GATE, sv)
        gweights, gexp = self._experts_backward(sv)
        gx = self._add_into(gx, gexp)
        gprobs = tp.new(4 * t * n_exp)  # top-k backward scatters into zeros
        tp.free(gweights, sv.pop("router.topk"))
        glogits = tp.new(4 * t * n_exp)
        tp.free(gprobs, sv.pop("router.probs"))
        grouter = tp.new(e * t * h)  # through the router's weight
        if self.s.expert_targets:
            tp.temp(4 * n_exp * h)  # the adapted weight's gradient, into its A and B
            r = self.s.lora_r
            self.lora_grads.append(tp.new(self.lb * r * h, GRADIENTS))
            self.lora_grads.append(tp.new(self.lb * n_exp * r, GRADIENTS))
        tp.free(glogits, sv.pop("router.w"))
        gx = self._add_into(gx, grouter)
        if gshared is not None:
            self._mlp_backward(gshared, sv, a.shared_expert_intermediate_size, into=gx)
            tp.free(gshared)
        return gx

    def _add_into(self, acc: int | None, g: int) -> int:
        """A gradient reaching an input that already has one is added into it in place."""
        if acc is None:
            return g
        self.tape.free(g)
        return acc

    def _experts_backward(self, sv: _Saved) -> tuple[int, int]:
        """`_experts_forward` backward: the sum and the reordering, the routing weights (their
        gradient too), the down projection (with an adapter, the whole stack's weight
        gradient, into B and A), silu * up, the gate/up projection (the same), the gather.
        Returns the routing weights' and the input's gradients."""
        a, tp, t, e = self.a, self.tape, self.t, self.e
        h, i = a.hidden_size, a.expert_intermediate_size
        pairs = t * a.experts_per_token
        adapted = bool(self.s.expert_targets)
        gw = tp.new(e * pairs * h)  # weighted[inv_perm]'s backward: zeros, rows put in
        tp.free(sv.pop("moe.inv"))
        gdnm = tp.new(e * pairs * h)  # grad * routing weight
        tp.temp(e * pairs * h)  # grad * output, summed into the weights' gradient
        gsw = tp.new(4 * pairs)
        tp.free(gw, sv.pop("moe.dnm"))
        gdn = tp.new(e * pairs * h)  # masked_fill
        tp.free(gdnm)
        gprod = tp.new(e * pairs * i)  # the grouped matmul's input gradient
        gwdn = self._expert_weight_grad("down_proj") if adapted else None
        tp.free(gdn, sv.pop("moe.prod"), sv.pop("moe.w_dn"))
        if gwdn is not None:
            self._expert_weight_backward("down_proj", gwdn)
        gact, gup = tp.new(e * pairs * i), tp.new(e * pairs * i)
        tp.free(gprod, sv.pop("moe.act"))
        ggate = tp.new(e * pairs * i)  # silu
        tp.free(gact)
        ggu = tp.new(e * pairs * 2 * i)  # the two halves' gradients concatenated
        tp.free(ggate, gup, sv.pop("moe.gum"))
        ggum = tp.new(e * pairs * 2 * i)  # masked_fill
        tp.free(ggu)
        gsel = tp.new(e * pairs * h)
        gwgu = self._expert_weight_grad("gate_up_proj") if adapted else None
        tp.free(ggum, sv.pop("moe.sel"), sv.pop("moe.w_gu"))
        gsel_m = tp.new(e * pairs * h)  # the gathered tokens' in-place masked_fill_
        tp.free(gsel, sv.pop("moe.mask"))
        if gwgu is not None:
            self._expert_weight_backward("gate_up_proj", gwgu)
        gweights = tp.new(4 * t * a.experts_per_token)  # sample_weights[perm]'s backward
        tp.free(gsw, sv.pop("moe.sw"), sv.pop("moe.perm"))
        gexp = tp.new(e * t * h)  # hidden_states[perm // top_k]'s: zeros, rows added in
        tp.free(gsel_m, sv.pop("moe.rows"))
        return gweights, gexp

    def _expert_weight_grad(self, name: str) -> int:
        """The grouped matmul's weight gradient: one tensor the size of the expert stack."""
        experts, out_f, in_f = self.a.expert_shapes()[name]
        return self.tape.new(self.e * experts * out_f * in_f)

    def _expert_weight_backward(self, name: str, grad: int) -> None:
        """baddbmm's backward into the LoRA factors: grad @ A^T (B's gradient, then made
        contiguous in B's layout) and B^T @ grad (A's, as it is); B's permuted view is copied
        contiguous again for the batched matmul."""
        tp, lb = self.tape, self.lb
        experts, out_f, in_f = self.a.expert_shapes()[name]
        rank = self.s.expert_rank(name) * experts
        glhs = tp.new(lb * out_f * rank)
        tp.temp(lb * out_f * rank)
        self.lora_grads.append(tp.new(lb * rank * in_f, GRADIENTS))
        tp.free(grad)
        self.lora_grads.append(tp.new(lb * out_f * rank, GRADIENTS))
        tp.free(glhs)

    # --- backward ops ----------------------------------------------------------------

    def _token_major(self, g: int, name: str) -> int:
        """q, k or v's output gradient, from the attention, as PEFT's branch takes it: a
        head-major one (all three from the math backend; q's and k's through rope from the
        fused kernels, whose v gradient is token-major already) is replaced by a token-major
        copy."""
        if name not in self.targets or (name == "v_proj" and not self.math):
            return g
        copy = self.tape.new(self.e * self.t * self.shapes[name][0])
        self.tape.free(g)
        return copy

    def _lora_backward(self, name: str, sv: _Saved, input_grad: bool) -> int | None:
        """PEFT's branch of a linear's backward: its A and B gradients (kept until zero_grad)
        and, with `input_grad`, its share of the input's gradient."""
        s, tp, t, e, lb = self.s, self.tape, self.t, self.e, self.lb
        out_f, in_f = self.shapes[name]
        gs = tp.new(e * t * out_f)  # grad * scaling
        self.lora_grads.append(tp.new(lb * out_f * s.lora_r, GRADIENTS))
        ga = tp.new(lb * t * s.lora_r)
        tp.free(gs, sv.pop(name + ".a"))
        self.lora_grads.append(tp.new(lb * s.lora_r * in_f, GRADIENTS))
        gxl = tp.new(lb * t * in_f) if input_grad else None
        tp.free(ga, sv.pop(name + ".in"), sv.pop(name + ".mask"))
        return gxl

    def _weight_grads_only(self, g: int, name: str, sv: _Saved, last_of: str | None = None) -> None:
        """A linear whose input needs no gradient (layer 0's q, k, v without checkpointing):
        only its LoRA weights get one."""
        g = self._token_major(g, name)
        if name in self.targets:
            self._lora_backward(name, sv, input_grad=False)
        if last_of:
            self.tape.free(sv.pop(last_of))
        self.tape.free(g)

    def _linear_backward(
        self,
        g: int,
        name: str,
        sv: _Saved,
        last_of: str | None = None,
        free_g: bool = True,
        into: int | None = None,
        head_major: bool = False,
    ) -> int:
        """Gradient of a LoRA'd 4-bit linear's input (LoRA weight gradients are kept), in
        autograd's order: the LoRA branch, then the base. `last_of` names the saved input this
        linear's LoRA A was the last user of; `g` dies once cast to bf16 unless told not to.
        Autograd sums an input's gradients in place where it can: the first one, straight out
        of a matmul, cannot take the second, so that sum is a new tensor; later ones go into
        it. `into` is such a sum, which this linear's gradients add to."""
        s, tp, t, e = self.s, self.tape, self.t, self.e
        out_f, in_f = self.shapes[name]
        gxl = None
        if head_major:
            g = self._token_major(g, name)
        if name in self.targets:
            gxl = self._lora_backward(name, sv, input_grad=True)
        if last_of:
            tp.free(sv.pop(last_of))
        if into is not None:
            tp.free(gxl)
            gxl = None
        if s.quantized:
            w = stored_weight(out_f * in_f, s.quant, s.blocksize, s.double_quant)
            gb = tp.new(2 * t * out_f) if e != 2 else None
            if free_g:
                tp.free(g)
            scales = tp.new(4 * w.nblocks)
            wb = tp.new(2 * out_f * in_f)
            tp.free(scales)
            gxb = tp.new(2 * t * in_f)
            tp.free(wb, gb)
            gx = tp.new(e * t * in_f) if e != 2 else gxb
            if e != 2:
                tp.free(gxb)
        else:
            gx = tp.new(e * t * in_f)
            if free_g:
                tp.free(g)
        if into is not None:
            tp.free(gx)
            return into
        if gxl is not None:
            acc = tp.new(e * t * in_f)
            tp.free(gx, gxl)
            gx = acc
        return gx

    def _rmsnorm_backward(
        self,
        g: int,
        width: int,
        rows: int,
        sv: _Saved,
        tag: str,
        free_g: bool,
        into: int | None = None,
        into_owned: bool = True,
    ) -> int:
        """Autograd's RMSNorm backward as traced: g * weight, the direct gradient of
        x * rsqrt, then the one through the mean of squares, float32 temporaries on the way;
        `g` dies after the first op when autograd's input buffer owns it. The two gradients
        of x meet in x's input buffer: the first to arrive holds the sum, later ones are added
        in place and die. With `into`, a gradient of x already in the buffer (the residual's),
        both are added into it; if something else holds `into` (a checkpoint holds the
        gradient it was given), the first sum is a new tensor, which takes the second."""
        tp, n = self.tape, 4 * rows * width
        gw = tp.new(n)  # g * weight
        if free_g:
            tp.free(g)
        part, direct = tp.new(n), tp.new(n)
        tp.free(part, gw)
        if into is not None:
            if not into_owned:
                into = tp.new(n)
            tp.free(direct)
        parts = [tp.new(n) for _ in range(4)]
        tp.free(*parts[:3], sv.pop(tag), parts[3])
        return direct if into is None else into

    def layer_backward(self, g: int, sv: _Saved, layer: int, hold_g: bool) -> int | None:
        """Gradient of the layer's input from `g`, the gradient of its output (freed unless
        `hold_g`: a checkpoint holds it, as it holds the recomputed output, until it returns)."""
        s, a, tp, t = self.s, self.a, self.tape, self.t
        h, qd, kvd = a.hidden_size, a.q_dim, a.kv_dim
        self.shapes = a.linear_shapes(layer)
        if a.is_sparse(layer):
            gxn2 = self._moe_backward(g, sv)
            tp.free(sv.pop("xn2"))
        else:
            gxn2 = self._mlp_backward(g, sv, a.intermediate_size)
        # the residual's gradient: the norm's gradients are summed into g's buffer
        g1 = self._rmsnorm_backward(
            gxn2, h, t, sv, "norm2", free_g=True, into=g, into_owned=not hold_g
        )
        tp.free(sv.pop("x1"))
        # attention
        # layer 0's input needs no gradient without checkpointing: o_proj is g1's last user
        input_grad = layer > 0 or s.grad_checkpointing
        goc = self._linear_backward(g1, "o_proj", sv, last_of="oc", free_g=not input_grad)
        if self.math:
            s2 = 4 * s.batch * a.num_heads * s.seq_len * s.seq_len
            if s.batch > 1:  # the batched matmuls take a contiguous copy of dO
                copy = tp.new(4 * t * qd)
                tp.free(goc)
                goc = copy
            gvr = tp.new(4 * t * qd)  # P^T dO
            gprobs = tp.new(s2)  # dO V^T
            tp.free(goc, sv.pop("vr"))
            gscores = tp.new(s2)  # softmax backward
            tp.free(tp.new(s2), gprobs, sv.pop("probs"))
            gkt, gqs = tp.new(4 * t * qd), tp.new(4 * t * qd)
            tp.free(gscores, sv.pop("qs"), sv.pop("kt"))
            gkr = tp.new(4 * t * qd)  # k's gradient back from the transpose
            tp.free(gkt)
            gv = tp.new(4 * t * kvd)  # v's and k's summed over the repeated heads
            tp.free(gvr)
            gk = tp.new(4 * t * kvd)
            tp.free(gkr)
            gq = tp.new(4 * t * qd)  # through q * scale
            tp.free(gqs)
        else:
            gq, gk, gv = tp.new(4 * t * qd), tp.new(4 * t * kvd), tp.new(4 * t * kvd)
            # two float32 work buffers of the kernel's backward, the second padded (as traced
            # on an H100 with llama-2-7b)
            tp.temp(4 * t * qd)
            tp.temp(4 * t * qd + 4 * s.batch * a.num_heads * 128)
            tp.free(goc)
            for name in ("o", "lse", "qe", "ke", "v"):
                tp.free(sv.pop(name))
        # (autograd reaches k first)
        gk = self._rope_backward(gk, kvd)
        gq = self._rope_backward(gq, qd)

        # then v, k and q down to their projections, in that order; without an input
        # gradient only their LoRA weights get one
        def project(grad: int, name: str, into: int | None, last: str | None = None) -> int | None:
            if not input_grad:
                self._weight_grads_only(grad, name, sv, last)
                return None
            return self._linear_backward(grad, name, sv, last, into=into, head_major=True)

        gxn = project(gv, "v_proj", None)
        if a.qk_norm:
            gkn = self._rmsnorm_backward(gk, a.head_dim, t * a.num_kv_heads, sv, "knorm", True)
            tp.free(sv.pop("k"))
            gk = gkn
        project(gk, "k_proj", gxn)
        if a.qk_norm:
            gqn = self._rmsnorm_backward(gq, a.head_dim, t * a.num_heads, sv, "qnorm", True)
            tp.free(sv.pop("q"))
            gq = gqn
        project(gq, "q_proj", gxn, last="xn")
        if gxn is None:
            return None
        return self._rmsnorm_backward(gxn, h, t, sv, "norm1", free_g=True, into=g1)

    def _rope_backward(self, g: int, width: int) -> int:
        """Gradient through x * cos + rotate_half(x) * sin, as traced: g * cos, the halves of
        g * sin swapped back, the sum of the two in x's input buffer (the first to arrive
        holds it), then the layout copy's gradient added in place too."""
        tp, t = self.tape, self.t
        gcos = tp.new(4 * t * width)
        half = tp.new(2 * t * width)
        total = tp.new(4 * t * width)
        tp.free(half)
        part = tp.new(4 * t * width)
        tp.free(gcos, part)
        tp.free(tp.new(4 * t * width), g)
        return total

    # --- a training step -------------------------------------------------------------

    def step(self) -> None:
        """One training step: forward, loss, backward, optimizer step, zero_grad."""
        s, a, tp, t, e = self.s, self.a, self.tape, self.t, self.e
        h, v = a.hidden_size, a.vocab_size
        gc = s.grad_checkpointing
        self.steps_done += 1
        first = self.steps_done == 1
        tp.step(self.steps_done)
        tp.phase("forward")
        if self.loop == "plain":
            # ids = torch.randint(...): the new ids exist before the old ones are dropped
            ids = tp.new(8 * t)
            tp.free(self.input_ids)
            self.input_ids = ids
        self._forward_begins()
        self.cache: list[int] = []
        self._embedding_begins()
        x = tp.new(e * t * h)  # embedding output
        self._embedding_ends()
        self._workspace(0)  # the rotary embedding's matmul is the forward's first
        rope = self._rotary_tables()
        inputs, saved = [x], []
        for layer in range(a.num_layers):
            self._layer_forward_begins(layer)
            out, sv = self.layer_forward(inputs[-1], layer, grad=not gc)
            self._layer_forward_ends(layer)
            saved.append(sv)
            inputs.append(out)
        last = inputs[-1]
        final_sv = _Saved(tp, True)
        xf = self._rmsnorm(last, h, t, final_sv, "final")
        if not gc:
            tp.free(x)  # the embedding output: no layer saved it, the model returns
        tp.phase("loss")
        tp.tag = LOGITS_LOSS
        self._head_begins(forward=True)
        head_out = tp.new(e * t * v) if self.recipe.cast_logits else None
        if head_out is not None:  # the head's output, cast to float32 by the loss
            self._head_ends()
        logits = tp.new(4 * t * v)
        if head_out is None:
            self._head_ends()
        tp.temp(8 * t)  # padded labels
        shifted = tp.new(8 * t)
        logp = tp.new(4 * t * v)
        tp.free(xf, logits)
        # the model's output (and its logits) dies once the loss is taken from it
        tp.free(head_out)
        for layer_kv in reversed(list(zip(self.cache[::2], self.cache[1::2], strict=True))):
            tp.free(*layer_kv)  # the cache goes last layer first
        self._forward_ends()
        # backward (its own thread): cross-entropy and lm_head
        self._backward_begins()
        gnll = tp.new(4 * t * v)
        tp.free(shifted)
        glogits = tp.new(4 * t * v)
        tp.free(gnll, logp)
        tp.tag = ACTIVATIONS
        if self.recipe.cast_logits:  # the cast's backward, then the head's in its dtype
            gb = tp.new(e * t * v, LOGITS_LOSS)
            tp.free(glogits)
            glogits = gb
        self._head_begins(forward=False)
        gxf = tp.new((e if self.recipe.cast_logits else 4) * t * h)
        self._workspace(1)
        tp.free(glogits)
        self._head_ends()
        tp.phase("backward")
        g = self._rmsnorm_backward(gxf, h, t, final_sv, "final", free_g=True)
        tp.free(last)
        grad: int | None = g
        for layer in reversed(range(a.num_layers)):
            assert grad is not None  # only layer 0's backward without checkpoints ends it
            self._layer_backward_begins(layer)
            if gc:
                out, sv = self.layer_forward(inputs[layer], layer, grad=True)
                grad_in = self.layer_backward(grad, sv, layer, hold_g=True)
                tp.free(out, grad)
            else:
                grad_in = self.layer_backward(grad, saved[layer], layer, hold_g=False)
            self._layer_backward_ends(layer)
            grad = grad_in
            if layer > 0 or gc:
                tp.free(inputs[layer])
        tp.free(grad, *rope)
        self._backward_ends()
        tp.phase("optimizer step")
        self._optimizer(first)

    def _rotary_tables(self) -> list[int]:
        """cos and sin of the positions (batch-broadcast): from the angles duplicated to the
        full head width, each computed, then scaled by the rope's attention scaling."""
        tp, n = self.tape, 4 * self.s.seq_len * self.a.head_dim
        angles = tp.new(n)
        tables = []
        for _ in range(2):
            raw = tp.new(n)
            tables.append(tp.new(n))
            tp.free(raw)
        tp.free(angles)
        return tables

    # --- what a distributed runtime adds (memory.distributed): nothing on one GPU ----------

    def _embedding_begins(self) -> None:
        """The input embeddings' forward begins."""

    def _embedding_ends(self) -> None:
        """The input embeddings' forward has returned."""

    def _head_begins(self, forward: bool) -> None:
        """The head's forward (or its backward) begins."""

    def _head_ends(self) -> None:
        """The head's forward (or its backward) has returned."""

    def _forward_begins(self) -> None:
        """The model is called (after the step's input ids exist)."""

    def _forward_ends(self) -> None:
        """The model's forward (the loss included) has returned."""

    def _backward_begins(self) -> None:
        """The gradient reaches the loss."""

    def _layer_forward_begins(self, layer: int) -> None:
        """Decoder layer `layer`'s forward starts."""

    def _layer_forward_ends(self, layer: int) -> None:
        """Decoder layer `layer`'s forward has returned."""

    def _layer_backward_begins(self, layer: int) -> None:
        """The gradient reaches decoder layer `layer` (before its recomputation, if any)."""

    def _layer_backward_ends(self, layer: int) -> None:
        """Decoder layer `layer`'s backward is done: its LoRA gradients are in `lora_grads`."""

    def _backward_ends(self) -> None:
        """The backward pass is over (before the optimizer step)."""

    def _optimizer_tensors(self) -> list[int]:
        """Element counts of the parameters the optimizer steps on this GPU."""
        return self.s.lora_tensors()

    def _optimizer(self, first: bool) -> None:
        s, tp = self.s, self.tape
        params = self._optimizer_tensors()
        if first:  # the states, made at the first step and kept
            for n in params:
                for state in optimizer_states(s.optimizer, n, self.lp):
                    tp.new(state, OPTIMIZER_STATES)
        temps = [
            tp.new(b, OPTIMIZER_STATES)
            for n in params
            for b in optimizer_temporaries(s.optimizer, n, self.lp)
        ]
        tp.free(*temps)
        tp.free(*self.lora_grads)  # zero_grad(set_to_none=True)
        self.lora_grads = []

    def events(self, steps: int = 2) -> list[Event]:
        """Setup and `steps` training steps."""
        self.setup()
        for _ in range(steps):
            self.step()
        return self.tape.events


def peft_bnb_events(s: TrainingSetup, loop: str = "plain", steps: int = 2) -> list[Event]:
    """The allocator events of setup and `steps` training steps of `loop`."""
    return PeftBnbTimeline(s, loop).events(steps)


__all__ = ["CUBLAS_WORKSPACE", "LOOPS", "PeftBnbTimeline", "Recipe", "Tape", "peft_bnb_events"]
