"""Smoke test of an installed nybble wheel, run by the interpreter it is installed in.

What a first user does, from outside the repository: import nybble, a quantize/dequantize
round trip checked against the numpy oracle, the CUDA sources embedded in the extension, a
Rust panic arriving as a Python exception, and `nybble demo --json` (through the installed
`nybble` script with --entry-point, else in this process).

    python .ci/smoke_test.py --kernels kernels [--entry-point]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np


def check(condition: bool, what: str) -> None:
    if not condition:
        raise SystemExit(f"smoke test failed: {what}")


def check_round_trip() -> None:
    import nybble
    from nybble import reference

    w = np.random.default_rng(7).standard_normal((96, 640)).astype(np.float32)
    for codebook in ("nf4", "fp4"):
        q = nybble.quantize(w, blocksize=64, codebook=codebook)
        codes, absmax = reference.quantize(w.reshape(-1), 64, codebook)
        check(np.array_equal(q.codes, codes), f"{codebook} codes differ from the oracle")
        check(np.array_equal(q.absmax, absmax), f"{codebook} scales differ from the oracle")
        back = q.dequantize("float32")
        expected = reference.dequantize(codes, absmax, w.size, 64, codebook).reshape(w.shape)
        check(np.array_equal(back, expected), f"{codebook} dequantize differs from the oracle")


def check_kernels(kernels_dir: Path) -> list[str]:
    import nybble._core as core

    shipped = core.kernel_sources()
    on_disk = {p.name: p.read_text() for p in kernels_dir.iterdir() if p.suffix in {".cu", ".cuh"}}
    check(bool(on_disk), f"no CUDA sources in {kernels_dir}")
    check(sorted(shipped) == sorted(on_disk), f"kernels {sorted(shipped)} != {sorted(on_disk)}")
    for name, text in on_disk.items():
        check(shipped[name] == text, f"the embedded {name} differs from {kernels_dir / name}")
    return sorted(shipped)


def check_panic_is_an_exception() -> None:
    import nybble._core as core

    try:
        core._panic("smoke")
    except BaseException as e:  # PyO3's PanicException derives from BaseException
        check(type(e).__name__ == "PanicException", f"a panic raised {type(e).__name__}")
    else:
        check(False, "_panic returned")


def check_demo(entry_point: bool) -> dict[str, object]:
    import nybble._core as core

    if entry_point:
        script = Path(sys.executable).with_name("nybble")
        check(script.is_file(), f"no `nybble` entry point beside {sys.executable}")
        done = subprocess.run(
            [str(script), "demo", "--json"], capture_output=True, text=True, check=False
        )
        check(done.returncode == 0, f"nybble demo --json exited {done.returncode}: {done.stderr}")
        output = done.stdout
    else:
        # In this process: under qemu-user a child process could not run the interpreter.
        from nybble.cli import main as cli

        captured = io.StringIO()
        with contextlib.redirect_stdout(captured):
            status = cli(["demo", "--json"])
        check(status == 0, f"nybble demo --json returned {status}")
        output = captured.getvalue()
    report: dict[str, object] = json.loads(output)
    blocksize = report["blocksize"]
    check(report["codebook"] == "nf4" and blocksize == 64, f"demo defaults: {report}")
    # 4-bit codes plus one float32 scale per block of 64.
    check(report["bits_per_parameter"] == 4 + 32 / 64, f"bits per parameter: {report}")
    # Each value rounds to its nearest code: at most half the widest gap between codes.
    values = core.codebook_values("nf4")
    bound = max(b - a for a, b in itertools.pairwise(values)) / 2
    error = report["max_error_over_absmax"]
    check(isinstance(error, float) and error <= bound * (1 + 1e-6), f"error {error} > {bound}")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=Path, required=True, help="the repository's kernels/")
    parser.add_argument(
        "--entry-point", action="store_true", help="run the CLI as the installed `nybble` script"
    )
    args = parser.parse_args()

    import nybble

    here = Path(nybble.__file__).resolve().parent
    repo = Path(__file__).resolve().parent.parent
    check(repo not in here.parents, f"nybble imported from the repository ({here})")
    check(nybble.__version__ == metadata.version("nybble"), "__version__ != the wheel's version")
    check_round_trip()
    kernels = check_kernels(args.kernels)
    check_panic_is_an_exception()
    report = check_demo(args.entry_point)
    print(f"smoke test passed: nybble {nybble.__version__} from {here}")
    print(f"  kernel_sources: {kernels}; simd: {report['simd']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
