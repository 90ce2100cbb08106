"""Explore with fresh seeds: the fuzz suites of the test suite, run once per seed.

    python -m tests.fuzz                  # 8 fresh random seeds
    python -m tests.fuzz --seeds 30       # 30 of them
    python -m tests.fuzz --seed 7 --seed 20261128 --scale 4

The test suite itself only runs fixed seeds (a commit passes or fails the same way on every
day and machine). This command runs the same suites with `NYBBLE_FUZZ_SEED` set to other
seeds (and hypothesis' codec properties with the `dev` profile and that seed), one pytest
process per seed, and prints each seed's outcome. A failure message names its case; once the
bug is fixed, add the case to `REGRESSIONS` (tests/fuzzing.py for the suites built on it,
tests/checkpoint/test_checkpoint_fuzz.py for the checkpoint tools), so that every test run keeps it.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TESTS = Path(__file__).resolve().parent
#: The fuzz tests proper (the harness checks beside them do not depend on the seed).
FUZZ_TESTS = [
    "lora/test_fuzz_adapter.py::test_fuzz_adapter_directories",
    "bnb/test_fuzz_bnb.py::test_fuzz_bitsandbytes_states",
    "memory/test_fuzz_estimator.py::test_fuzz_estimator_configs_and_arguments",
    "codec/test_fuzz_codec.py",
    "checkpoint/test_checkpoint_fuzz.py::test_fuzz_safetensors_reader",
    "checkpoint/test_checkpoint_fuzz.py::test_fuzz_checkpoint_tools",
    "checkpoint/test_checkpoint_fuzz.py::test_fuzz_through_the_command_line",
]


def run_seed(seed: int, scale: float, log_dir: Path) -> tuple[int, bool, float, Path]:
    env = dict(os.environ)
    env.update(
        NYBBLE_FUZZ_SEED=str(seed),
        NYBBLE_FUZZ_SCALE=str(scale),
        NYBBLE_FUZZ_CASES=str(round(24_000 * scale)),
        HYPOTHESIS_PROFILE="dev",
    )
    log = log_dir / f"seed-{seed}.log"
    started = time.perf_counter()
    with open(log, "wb") as out:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                f"--hypothesis-seed={seed}",
                *(str(TESTS / t) for t in FUZZ_TESTS),
            ],
            cwd=TESTS.parent,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        )
    return seed, done.returncode == 0, time.perf_counter() - started, log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fuzz", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--seeds", type=int, default=8, help="fresh random seeds to run (default 8)"
    )
    parser.add_argument(
        "--seed", type=int, action="append", default=[], help="a given seed (repeatable)"
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiplies every suite's cases (default 1)"
    )
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="seeds run at once (default: CPUs)"
    )
    parser.add_argument("--logs", type=Path, default=Path("fuzz-logs"), help="one log per seed")
    args = parser.parse_args(argv)
    seeds = args.seed or [secrets.randbits(32) for _ in range(args.seeds)]
    args.logs.mkdir(parents=True, exist_ok=True)
    print(f"fuzzing {len(seeds)} seed(s) at scale {args.scale}, {args.jobs} at a time")
    failed = []
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        runs = [pool.submit(run_seed, s, args.scale, args.logs) for s in seeds]
        for run in runs:
            seed, ok, seconds, log = run.result()
            print(
                f"  seed {seed}: {'passed' if ok else 'FAILED'} in {seconds:.0f} s ({log})",
                flush=True,
            )
            if not ok:
                failed.append(seed)
    if failed:
        print(
            f"{len(failed)} seed(s) failed: {' '.join(map(str, failed))}; their logs name the cases"
        )
        return 1
    print("every seed passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
