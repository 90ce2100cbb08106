"""Finding a model's files: a local path, or a Hugging Face Hub id whose files are already in
the local Hub cache (nybble downloads nothing)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import FormatError

#: `org/name` (the Hub's repo ids), optionally `@revision`.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def hub_cache() -> Path:
    """Where the Hub's client keeps its files: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub (the client's own rule)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home) / "hub"


def resolve(spec: str | os.PathLike[str]) -> Path:
    """The local path of a model: `spec` itself when it exists, else the snapshot of a Hub id
    (`org/name` or `org/name@revision`) in the local cache. FormatError saying where it
    looked otherwise."""
    path = Path(spec)
    if path.exists():
        return path
    text = str(spec)
    if not _HUB_ID.match(text):
        raise FormatError(text, "not found (neither a path nor a Hugging Face Hub id org/name)")
    repo, _, revision = text.partition("@")
    cache = hub_cache()
    folder = cache / ("models--" + repo.replace("/", "--"))
    revision = revision or "main"
    ref = folder / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = folder / "snapshots" / commit
    if not snapshot.is_dir():
        raise FormatError(
            text,
            f"not a local path, and not in the Hugging Face cache ({cache}) at revision "
            f"{revision}; nybble downloads nothing: fetch it first (`hf download {repo}`)",
        )
    return snapshot


__all__ = ["hub_cache", "resolve"]
