"""Text generation with a key/value cache: the prompt in one forward pass, then a token at a
time (greedy, or sampled with a temperature and top-p), stopping at an end-of-sequence token
or after `max_new_tokens` (docs/training.md, "Trying the result")."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .model import DecoderLM


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
) -> Generation:
    """Continues `prompt` (token ids): see the module docstring. `on_token` is called with
    each new token as it is made (a stop token excepted)."""
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
        logits = model.next_logits(backend.from_host(np.asarray([ids], np.int64)), cache, 0)
        token = pick(np.asarray(backend.to_host(logits))[0], temperature, top_p, rng)
        prefill = time.perf_counter() - started
        out: list[int] = []
        stopped = "length"
        position = len(ids)
        started = time.perf_counter()
        while True:
            if token in stops:
                stopped = "stop"
                break
            out.append(token)
            if on_token is not None:
                on_token(token)
            if len(out) == max_new_tokens:
                break
            step = backend.from_host(np.asarray([[token]], np.int64))
            logits = model.next_logits(step, cache, position)
            position += 1
            token = pick(np.asarray(backend.to_host(logits))[0], temperature, top_p, rng)
        decode = time.perf_counter() - started
    finally:
        model.cast_adapters(False)
        model.train(was_training)
    return Generation(out, stopped, len(ids), prefill, decode)


__all__ = ["Generation", "check_sampling", "generate", "pick"]
