"""The layering of docs/architecture.md, checked against the package's own imports, so that
a rule cannot break silently: the layer list is read from the doc ("Who imports whom", the
block after the paragraph naming this file), every import statement of every module is read
with `ast` (function-level and type-checking ones included), and each must point to a lower
layer. Also: no import circle between the package's modules and subpackages, the oracle
imported by no module, the device modules of the seam (`backends.cpu`, `backends.cuda`)
imported only inside it (and by `nybble.cuda`, the GPU-only public functions), and no device
library (CuPy) imported by the trainer's modules, which reach the device through a backend."""

from __future__ import annotations

import ast
import itertools
import re
from collections import defaultdict
from pathlib import Path

import pytest

from tests import ROOT

PACKAGE = ROOT / "python" / "nybble"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

#: Imports of the seam's device modules from outside it, left to the rewrite of torch/ (issue
#: 40): delete an entry once its import is gone (a stale entry fails the test).
KNOWN_DEVICE_IMPORTS = {
    ("torch", "nybble.backends.cpu"),
    ("torch", "nybble.backends.cuda.arrays"),
}

#: The device libraries: their arrays and calls belong behind the seam (backends/).
DEVICE_LIBRARIES = ("cupy", "cupyx", "cupy_backends")


def _layers() -> list[list[str]]:
    """The doc's layer list, lowest first: the fenced block after the paragraph that names
    this test file, one layer a line."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    found = re.search(r"tests/docs/test_layering\.py.*?```text\n(.*?)```", text, re.S)
    assert found, f"{ARCHITECTURE}: no layer list (a ```text block after the note naming me)"
    return [line.split() for line in found.group(1).splitlines() if line.strip()]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    """Whether the dotted name under the package is a module or package (not an attribute)."""
    base = PACKAGE.parent.joinpath(*name.split("."))
    return (
        base.with_suffix(".py").is_file()
        or (base / "__init__.py").is_file()
        or base.with_suffix(".pyi").is_file()  # the extension, _core
    )


def _imports(path: Path) -> list[tuple[str, int]]:
    source = path.read_text(encoding="utf-8")
    return _imports_of(_module_name(path), path.name == "__init__.py", source, str(path))


def _imports_of(
    module: str, is_package: bool, source: str, filename: str = "<source>"
) -> list[tuple[str, int]]:
    """(imported module, line) of every import of the package in one module's source,
    relative ones resolved, `from package import name` counted as the submodule where `name`
    is one."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "nybble"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "nybble":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if _is_module(sub) else target, node.lineno))
    return found


def _unit(module: str) -> str:
    """The layer unit of a module: the package's module or subpackage it is in (`__init__`
    for the package's own __init__.py)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, dict[str, list[str]]]:
    """unit -> imported unit -> where ("file:line"), imports within a unit left out."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(PACKAGE.rglob("*.py")):
        src = _unit(_module_name(path))
        for target, line in _imports(path):
            dst = _unit(target)
            if dst != src:
                where = f"{path.relative_to(ROOT)}:{line}"
                if where not in graph[src][dst]:
                    graph[src][dst].append(where)
    return graph


def _units() -> set[str]:
    found = {p.stem for p in PACKAGE.glob("*.py")} | {p.stem for p in PACKAGE.glob("*.pyi")}
    found |= {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    return found


def test_the_layer_list_names_every_module_once() -> None:
    listed = [name for layer in _layers() for name in layer]
    assert len(listed) == len(set(listed)), f"named twice: {listed}"
    assert set(listed) == _units(), (
        f"not in the doc's layer list: {sorted(_units() - set(listed))}; "
        f"listed but not in the package: {sorted(set(listed) - _units())}"
    )


def test_imports_point_down_the_layers() -> None:
    level = {name: i for i, layer in enumerate(_layers()) for name in layer}
    wrong = [
        f"{src} (layer {level[src]}) imports {dst} (layer {level[dst]}) at {', '.join(where)}"
        for src, targets in sorted(_graph().items())
        for dst, where in sorted(targets.items())
        if src in level and dst in level and level[dst] >= level[src]
    ]
    assert not wrong, "imports that do not point to a lower layer:\n" + "\n".join(wrong)


def test_no_import_circles() -> None:
    graph = _graph()
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, {})):
            if nxt == path[0]:
                circles.append([*path, nxt])
            elif nxt not in path and nxt > path[0]:  # each circle once, from its least unit
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    lines = [
        " -> ".join(c) + "  (" + "; ".join(graph[a][b][0] for a, b in itertools.pairwise(c)) + ")"
        for c in circles
    ]
    assert not circles, "import circles between the package's modules:\n" + "\n".join(lines)


def test_the_oracle_is_imported_by_no_module() -> None:
    """reference.py is for tests; the package's __init__ names it for type checkers only."""
    importers = {
        src: where
        for src, targets in _graph().items()
        for dst, where in targets.items()
        if dst == "reference" and src != "__init__"
    }
    assert not importers, f"modules importing nybble.reference: {importers}"


def test_device_modules_are_imported_only_through_the_seam() -> None:
    """Outside backends/, a module asks `backends.of(x)` / `backends.get(device)` for a
    backend; it does not import `backends.cpu` or `backends.cuda`. nybble.cuda, the public
    GPU-only functions, is the one exception."""
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        src = _unit(_module_name(path))
        if src in ("backends", "cuda"):
            continue
        for target, line in _imports(path):
            if target.startswith(("nybble.backends.cpu", "nybble.backends.cuda")):
                found[(src, target)].append(f"{path.relative_to(ROOT)}:{line}")
    wrong = {k: v for k, v in found.items() if k not in KNOWN_DEVICE_IMPORTS}
    assert not wrong, f"device modules imported outside the seam: {wrong}"
    stale = KNOWN_DEVICE_IMPORTS - set(found)
    assert not stale, f"gone: delete them from KNOWN_DEVICE_IMPORTS: {stale}"


def _library_imports(source: str) -> list[tuple[str, int]]:
    """(top-level package, line) of every absolute import in a module's source, function-level
    and type-checking ones included."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(a.name.split(".")[0], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.module.split(".")[0], node.lineno))
    return found


def test_the_trainer_imports_no_device_library() -> None:
    """train/ is written once over the seam: its device decisions are the backend's
    (`Backend.float32_products`, `cuda_kernels`, `default_compute_dtype`, `matmul_in_dtype`),
    and its fused kernels (train/_cuda.py) are compiled by the backend (`kernel_module`, whose
    kernels launch through the core's launcher) over the backend's arrays (`xp`), so none of
    its modules imports CuPy."""
    importers: dict[str, list[str]] = defaultdict(list)
    for path in sorted((PACKAGE / "train").rglob("*.py")):
        for package, line in _library_imports(path.read_text(encoding="utf-8")):
            if package in DEVICE_LIBRARIES:
                importers[_module_name(path)].append(f"{path.relative_to(ROOT)}:{line}")
    assert not importers, f"train/ modules importing a device library: {dict(importers)}"


def test_library_imports_are_read_at_every_level() -> None:
    source = (
        "import numpy as np\nfrom . import functional\n"
        "def f():\n    import cupy as cp\n    from cupyx.scipy import special\n"
    )
    assert _library_imports(source) == [("numpy", 1), ("cupy", 4), ("cupyx", 5)]


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("nybble.bnb", "from .backends import cpu\n", [("nybble.backends.cpu", 1)]),
        (
            "nybble.lora.adapter",
            "def f():\n    from ..checkpoint import Checkpoint\n",
            [("nybble.checkpoint", 2)],
        ),
        ("nybble.lora.adapter", "import nybble.tensor\n", [("nybble.tensor", 1)]),
        (
            "nybble.tensor",
            "from . import formats, __version__\n",
            [("nybble.formats", 1), ("nybble", 1)],
        ),
        ("nybble.tensor", "import numpy\nfrom typing import Any\n", []),
    ],
)
def test_imports_are_read_with_their_level_and_names(
    module: str, source: str, expected: list[tuple[str, int]]
) -> None:
    """The reader itself: relative levels, function-level imports, submodules by name."""
    assert _imports_of(module, False, source) == expected
    assert _imports_of("nybble.backends", True, "from . import cpu\n") == [
        ("nybble.backends.cpu", 1)
    ]
