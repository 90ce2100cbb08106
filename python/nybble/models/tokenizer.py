"""A model's tokenizer: Hugging Face's `tokenizers` library on the model's tokenizer.json (or
on the vocabulary a GGUF file carries, built as transformers builds it), the special tokens
and chat template of tokenizer_config.json, rendered with jinja2 as transformers renders it.
Needs the `train` extra (`pip install "nybble[train]"`: tokenizers, jinja2)."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from .._json import read_file as read_json
from ..errors import FormatError

#: GGUF token types: llama.cpp marks special tokens CONTROL and added ones USER_DEFINED.
_CONTROL, _USER_DEFINED = 3, 4
#: Split patterns of llama.cpp pre-tokenizer names (the ones transformers maps too).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _require(module: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise ImportError(
            f'reading a model\'s tokenizer needs the {module} package: pip install "nybble[train]"'
        ) from None


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's spelling of the 256 bytes as printable characters (byte-level BPE)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


class Tokenizer:
    """Text to token ids and back, with the model's special tokens and chat template."""

    def __init__(
        self,
        backend: Any,
        *,
        source: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        stop_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.chat_template = chat_template
        self.bos_id = self.token_id(bos_token)
        self.eos_id = self.token_id(eos_token)
        pad = self.token_id(pad_token)
        self.pad_id = pad if pad is not None else (self.eos_id or 0)
        stops = [int(i) for i in stop_ids]
        if self.eos_id is not None and self.eos_id not in stops:
            stops.insert(0, self.eos_id)
        #: generation stops at any of these (the EOS token and generation_config's)
        self.stop_ids = tuple(stops)

    # --- construction -----------------------------------------------------------------------

    @classmethod
    def from_directory(cls, directory: str | os.PathLike[str]) -> Tokenizer:
        """tokenizer.json, with tokenizer_config.json's special tokens and chat template
        (or chat_template.jinja / .json beside it) and generation_config.json's EOS ids."""
        tokenizers = _require("tokenizers")
        d = Path(directory)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise FormatError(d, "has no tokenizer.json (nybble reads HF fast tokenizers)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library's parse errors are plain Exceptions
            raise FormatError(path, f"not a tokenizer the tokenizers library reads ({e})") from None
        config = _optional_json(d / "tokenizer_config.json")
        special = _optional_json(d / "special_tokens_map.json")
        template = _chat_template(d, config)
        generation = _optional_json(d / "generation_config.json")
        return cls(
            backend,
            source=str(d),
            bos_token=_token_text(config.get("bos_token", special.get("bos_token"))),
            eos_token=_token_text(config.get("eos_token", special.get("eos_token"))),
            pad_token=_token_text(config.get("pad_token", special.get("pad_token"))),
            chat_template=template,
            stop_ids=_id_list(generation.get("eos_token_id")),
        )

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], source: str) -> Tokenizer:
        """The tokenizer a GGUF file's `tokenizer.*` metadata describes (byte-level BPE, the
        `gpt2` model), built as transformers builds it from the same file."""
        tokenizers = _require("tokenizers")
        kind = meta.get("model")
        if kind != "gpt2":
            raise FormatError(
                source,
                f"tokenizer model {kind!r} is not read from GGUF files (nybble reads byte-level "
                "BPE, 'gpt2'); use the model's Hugging Face checkpoint",
                "tokenizer.ggml.model",
            )
        tokens, merges = meta.get("tokens"), meta.get("merges")
        if not isinstance(tokens, list) or not isinstance(merges, list):
            raise FormatError(source, "needs tokens and merges", "tokenizer.ggml.tokens")
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab: dict[str, int] = {}
        for index, text in enumerate(tokens):
            if not set(text) <= alphabet:
                text = "".join(spelling[b] for b in text.encode("utf-8"))
            vocab.setdefault(text, index)
        pairs = []
        for merge in merges:
            parts = merge.split(" ")
            if len(parts) != 2:
                raise FormatError(source, f"a merge {merge!r} is not two tokens", "merges")
            pairs.append((parts[0], parts[1]))
        models, pre, dec, proc = (
            tokenizers.models,
            tokenizers.pre_tokenizers,
            tokenizers.decoders,
            tokenizers.processors,
        )
        backend = tokenizers.Tokenizer(models.BPE(vocab, pairs, fuse_unk=False))
        split = GGUF_SPLITS.get(meta.get("pre", ""))
        if split is None:
            backend.pre_tokenizer = pre.ByteLevel(add_prefix_space=False)
        else:
            backend.pre_tokenizer = pre.Sequence(
                [
                    pre.Split(tokenizers.Regex(split), behavior="isolated"),
                    pre.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        backend.decoder = dec.ByteLevel()
        backend.post_processor = proc.ByteLevel(trim_offsets=False)
        kinds = meta.get("token_type") or []
        control = [
            tokenizers.AddedToken(t, normalized=False, special=True)
            for t, k in zip(tokens, kinds, strict=False)
            if k == _CONTROL and set(t) <= alphabet
        ]
        backend.add_special_tokens(control)
        backend.add_tokens(
            [
                tokenizers.AddedToken(t, normalized=False, special=False)
                for t, k in zip(tokens, kinds, strict=False)
                if k == _USER_DEFINED and t in vocab
            ]
        )

        def special(key: str) -> str | None:
            index = meta.get(key)
            return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

        bos = special("bos_token_id")
        if meta.get("add_bos_token") and bos is not None:
            backend.post_processor = proc.Sequence(
                [
                    proc.ByteLevel(trim_offsets=False),
                    proc.TemplateProcessing(
                        single=f"{bos} $A",
                        pair=f"{bos} $A {bos} $B",
                        special_tokens=[(bos, vocab[bos])],
                    ),
                ]
            )
        template = meta.get("chat_template")
        return cls(
            backend,
            source=source,
            bos_token=bos,
            eos_token=special("eos_token_id"),
            pad_token=special("padding_token_id"),
            chat_template=template if isinstance(template, str) else None,
        )

    def files(self) -> dict[str, bytes]:
        """tokenizer.json and tokenizer_config.json as transformers reads them (what a saved
        model carries, whichever files this tokenizer came from)."""
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for key in ("bos_token", "eos_token", "pad_token"):
            if getattr(self, key) is not None:
                config[key] = getattr(self, key)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        return {
            "tokenizer.json": self.backend.to_str().encode("utf-8"),
            "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode("utf-8"),
        }

    # --- use --------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        found = self.backend.token_to_id(token)
        return None if found is None else int(found)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_with_offsets(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and the [start, end) character span each covers (special tokens added
        by the template cover (0, 0))."""
        enc = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return list(enc.ids), [tuple(o) for o in enc.offsets]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False
    ) -> str:
        """The chat template applied to messages ([{role, content}]), as transformers'
        `apply_chat_template(tokenize=False)` renders it."""
        if self.chat_template is None:
            raise ValueError(f"{self.source}: the tokenizer has no chat template")
        template = _compile_template(self.chat_template)
        return str(
            template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                pad_token=self.pad_token or "",
            )
        )


@functools.cache
def _compile_template(text: str) -> Any:
    """transformers' rendering environment: a sandbox, trim_blocks and lstrip_blocks, loop
    controls, `raise_exception`, `tojson` without ASCII escapes, `strftime_now`."""
    _require("jinja2")
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"the chat template refused the messages: {message}")

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, **kw: Any) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except TemplateError as e:
        raise ValueError(f"the chat template does not compile: {e}") from None


def _optional_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    value = read_json(path)
    if not isinstance(value, dict):
        raise FormatError(path, "not a JSON object")
    return value


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, chat_template.json, or
    tokenizer_config.json's `chat_template` (a string, or named templates of which
    `default`)."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template: Any = _optional_json(directory / "chat_template.json").get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


__all__ = ["Tokenizer", "bytes_to_unicode"]
