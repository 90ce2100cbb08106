"""Text generation with a key/value cache: the prompt in one forward pass, then a token at a
time (greedy, or sampled with a temperature and top-p), stopping at an end-of-sequence token
or after `max_new_tokens` (docs/training.md, "Trying the result").

On the GPU the one-token step is captured once in a CUDA graph (its shapes fixed: attention
over the whole cache, the position held on the device) and replayed for every next token:
one launch and one small read-back per token instead of the Python of every operation."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..backends import Array, Graph
from .model import DecoderLM, LayerCache


@dataclass
class Generation:
    """What `generate` made: the new token ids (the stop token not included), why it stopped
    ("stop" at a stop token, "length" at max_new_tokens), and its speed."""

    ids: list[int]
    stopped: str
    prompt_tokens: int
    #: seconds for the prompt's forward pass (time to the first new token) and the rest
    prefill_seconds: float
    decode_seconds: float
    #: whether the decode steps replayed a captured CUDA graph, and why not if one failed
    graph: bool = False
    graph_error: str | None = None
    #: the new tokens as text (where a tokenizer made the prompt)
    text: str | None = None

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of decoding (the prompt's pass not counted)."""
        steps = max(len(self.ids) - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def pick(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """The next token from float32 logits [vocab]: the most likely with temperature 0, else a
    draw from softmax(logits / temperature) kept to the smallest set of most likely tokens
    whose probability reaches top_p (nucleus sampling)."""
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cumulative = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cumulative, top_p)) + 1]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return int(rng.choice(p.size, p=p))


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ValueError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not (isinstance(temperature, (int, float)) and 0 <= temperature < float("inf")):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def generate(
    model: DecoderLM,
    prompt: Sequence[int],
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    on_token: Callable[[int], None] | None = None,
    graph: bool = True,
) -> Generation:
    """Continues `prompt` (token ids): see the module docstring. `on_token` is called with
    each new token as it is made (a stop token excepted); `graph=False` runs every step
    eagerly (the GPU's graph replays the same operations)."""
    check_sampling(max_new_tokens, temperature, top_p)
    ids = [int(i) for i in prompt]
    vocab = model.config.vocab_size
    if not ids:
        raise ValueError("prompt: expected at least one token")
    if min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"prompt: token ids must be in [0, {vocab}), got [{min(ids)}, {max(ids)}]")
    rng = np.random.default_rng(seed)
    stops = set(int(i) for i in stop_ids)
    backend = model.backend
    was_training = model.training
    model.train(False)
    model.cast_adapters(True)
    try:
        cache = model.new_cache(1, len(ids) + max_new_tokens)
        started = time.perf_counter()
        first = model.next_logits(backend.from_host(np.asarray([ids], np.int64)), cache, 0)
        token = pick(np.asarray(backend.to_host(first))[0], temperature, top_p, rng)
        del first
        prefill = time.perf_counter() - started
        out: list[int] = []
        stopped = "length"
        position = len(ids)
        started = time.perf_counter()
        step = _Step(model, cache, temperature == 0, graph)
        while True:
            if token in stops:
                stopped = "stop"
                break
            out.append(token)
            if on_token is not None:
                on_token(token)
            if len(out) == max_new_tokens:
                break
            logits = step(token, position)
            position += 1
            token = logits if isinstance(logits, int) else pick(logits, temperature, top_p, rng)
        decode = time.perf_counter() - started
    finally:
        model.cast_adapters(False)
        model.train(was_training)
    return Generation(
        out, stopped, len(ids), prefill, decode, step.graph is not None, step.graph_error
    )


class _Step:
    """One decode step: token and position in, the next token (greedy: argmax on the
    device) or the host's float32 logits out. On a device with graphs, captured at its first
    call and replayed after."""

    def __init__(
        self, model: DecoderLM, cache: list[LayerCache], greedy: bool, graph: bool
    ) -> None:
        self.model = model
        self.cache = cache
        self.greedy = greedy
        self.use_graph = graph
        self.graph: Graph | None = None
        xp = model.xp
        self.token = xp.zeros((1, 1), np.int64)
        self.position = xp.zeros(1, np.int32)
        self.result: Array | None = None
        self.graph_error: str | None = None

    def _work(self) -> None:
        logits = self.model.logits_at(self.token, self.cache, self.position)
        self.result = self.model.xp.argmax(logits[0]) if self.greedy else logits

    def __call__(self, token: int, position: int) -> int | np.ndarray:
        self.token.fill(token)
        self.position.fill(position)
        backend = self.model.backend
        if self.graph is None and self.use_graph:
            self.use_graph = False
            try:
                self.graph = backend.capture(self._work, self.token, self.position)
            except Exception as e:  # the step runs eagerly, the same operations
                self.graph_error = f"{type(e).__name__}: {e}"
            if self.graph is None:  # no graphs on this device, or the capture failed
                self._work()
            else:  # the capture only recorded the step (its warm-up ran it once, eagerly)
                self.graph.replay()
        elif self.graph is not None:
            self.graph.replay()
        else:
            self._work()
        # `_work` set the result above (eagerly, or in the capture's warm-up run)
        host = np.asarray(backend.to_host(self.result))  # type: ignore[arg-type]
        return int(host) if self.greedy else host[0]


__all__ = ["Generation", "check_sampling", "generate", "pick"]
