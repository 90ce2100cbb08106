"""Estimate vs measured: `nybble.estimate_memory` against the totals measure_peft_bnb.py wrote.

    python benchmarks/memory/compare.py --measured OUT/results.jsonl           # table
    python benchmarks/memory/compare.py --measured OUT/results.jsonl --write RESULTS_DIR
    python benchmarks/memory/compare.py                                        # committed run

Every measured run is estimated with the same architecture (the config fields the run
recorded), layer count, batch, sequence length, gradient checkpointing, LoRA rank/dropout,
optimizer and training loop. The error is `(estimate - measured) / measured` of the protocol's
total: the steady step's reserved peak plus the process's memory outside the allocator after
it (NVML minus `memory_reserved()`), the largest over steps 2 on. `covered` says whether the
measured total is within the estimate plus its stated margin, `counted` whether it is within
`required_bytes`, the figure the verdicts compare with a GPU (docs/estimator.md).

Without `--measured` it compares the committed validation run (tests/fixtures/memory/
results.jsonl) and issue 39's run (issue39.jsonl): the measured runs are kept once, as the
tests' fixtures; the comparisons it writes go to benchmarks/memory/results. Rows of the
fixtures' old-protocol/measured.jsonl and holdout.jsonl are marked `old protocol`: they were
measured with the benchmark loop before the protocol counted the memory outside the allocator
after a step. Their total is recomputed under the new definition from what they recorded (step
2's reserved peak plus NVML minus reserved at the end of the run) and compared with the
benchmark loop's estimate.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: Where the comparisons are written (`--write`), and the measured runs they compare.
RESULTS = HERE / "results"
MEASURED = HERE.parents[1] / "tests" / "fixtures" / "memory"
#: The accuracy the estimator is held to (issue 18).
TOLERANCE = 0.03


def _import_memory() -> Any:
    from nybble import memory

    return memory


def measured_total(rec: dict[str, Any]) -> tuple[int | None, str]:
    """(the measured total (docs/estimator.md), the protocol it was measured with)."""
    if "run" in rec:  # written by this measure_peft_bnb.py
        protocol = "dry run" if rec.get("dry_run") else "new"
        return rec.get("measured_total"), protocol
    if "step2" in rec and rec.get("nvml_process_end") is not None:
        outside = rec["nvml_process_end"] - rec["step3"]["phases"]["end"]["reserved"]
        return rec["step2"]["peak_reserved"] + outside, "old protocol"
    return None, "old protocol"


def estimate_for(rec: dict[str, Any]) -> Any:
    memory = _import_memory()
    if "config" in rec:
        config = dict(rec["config"], num_hidden_layers=rec["layers"])
    else:
        config = dict(memory.MODEL_PRESETS[rec["arch"]], num_hidden_layers=rec["layers"])
    loop = rec.get("loop", "benchmark" if "step2" in rec else "plain")
    return memory.estimate_memory(
        config,
        lora_r=rec.get("r", 16),
        lora_dropout=rec.get("dropout", 0.0),
        optimizer=rec.get("optim", "adamw"),
        batch=rec["batch"],
        seq_len=rec["seq"],
        grad_checkpointing=rec["gc"],
        loop=loop,
    )


def _variant(rec: dict[str, Any]) -> str:
    return " ".join(f"{k}={rec[k]}" for k in ("r", "dropout", "optim") if k in rec)


def records(path: Path) -> list[dict[str, Any]]:
    """The records of a results file; of a run measured twice in one set (again alone, after
    sharing the GPU went wrong) the last. Two sets may measure the same configuration (the
    diagnose pair is in the committed set too): both are kept."""
    found: dict[Any, dict[str, Any]] = {}
    for n, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            rec = json.loads(line)
            key = (rec.get("set"), rec["run"]) if "run" in rec else n
            found[key] = rec
    return list(found.values())


def rows(path: Path, set_name: str | None = None) -> list[dict[str, Any]]:
    out = []
    for rec in records(path):
        base = dict(
            set=rec.get("set", set_name or path.stem),
            arch=rec["arch"],
            layers=rec["layers"],
            batch=rec["batch"],
            seq_len=rec["seq"],
            grad_checkpointing=rec["gc"],
            variant=_variant(rec),
            loop=rec.get("loop", "benchmark" if "step2" in rec else "plain"),
        )
        total, protocol = measured_total(rec)
        base["protocol"] = protocol
        if "error" in rec or total is None:
            out.append(dict(base, error=rec.get("error", "no measured total")))
            continue
        try:
            est = estimate_for(rec)
        except ValueError as e:
            out.append(dict(base, measured_total=total, error=f"estimate: {e}"))
            continue
        err = (est.total_bytes - total) / total
        reserved = rec.get("measured_reserved") or rec.get("step2", {}).get("peak_reserved")
        allocated = rec.get("measured_allocated") or rec.get("step2", {}).get("peak_allocated")
        out.append(
            dict(
                base,
                measured_total=total,
                estimated_total=est.total_bytes,
                error_total=err,
                within_tolerance=abs(err) <= TOLERANCE,
                margin=est.margin_bytes,
                covered=total <= est.total_bytes + est.margin_bytes,
                required=est.required_bytes,
                counted=total <= est.required_bytes,
                measured_reserved=reserved,
                estimated_reserved=est.reserved_peak_bytes,
                measured_allocated=allocated,
                estimated_allocated=est.allocated_peak_bytes,
                measured_outside=rec.get("outside_bytes"),
                estimated_outside=est.context_bytes,
                steady_step=rec.get("steady_step"),
                step_reserved=[s["peak_reserved"] for s in rec.get("steps", [])],
                peak_phase=est.peak_phase,
            )
        )
    return out


def render(table: list[dict[str, Any]]) -> str:
    gib = 2**30
    lines = [
        "| set | model (layers) | batch | seq | grad ckpt | loop | measured GiB | estimate GiB "
        "| error | margin GiB | verdict counts GiB | protocol |",
        "|---|---|--:|--:|---|---|--:|--:|--:|--:|--:|---|",
    ]
    for r in table:
        name = f"{r['arch']} ({r['layers']}){' ' + r['variant'] if r['variant'] else ''}"
        head = (
            f"| {r['set']} | {name} | {r['batch']} | {r['seq_len']} | "
            f"{'on' if r['grad_checkpointing'] else 'off'} | {r['loop']} |"
        )
        if "error" in r:
            lines.append(f"{head} | | FAILED: {r['error'][:80]} | | | {r['protocol']} |")
            continue
        lines.append(
            f"{head} {r['measured_total'] / gib:.3f} | {r['estimated_total'] / gib:.3f} | "
            f"{100 * r['error_total']:+.2f}% | {r['margin'] / gib:.2f} | "
            f"{r['required'] / gib:.3f} | {r['protocol']} |"
        )
    lines.append("")
    for set_name in dict.fromkeys(r["set"] for r in table):
        for protocol in dict.fromkeys(r["protocol"] for r in table if r["set"] == set_name):
            mine = [r for r in table if r["set"] == set_name and r["protocol"] == protocol]
            ok = [r for r in mine if "error" not in r]
            failed = len(mine) - len(ok)
            if not ok:
                lines.append(f"{set_name} ({protocol}): {failed} failed, none measured")
                continue
            worst = max(ok, key=lambda r: abs(r["error_total"]))
            within = sum(r["within_tolerance"] for r in ok)
            covered = sum(r["covered"] for r in ok)
            counted = sum(r["counted"] for r in ok)
            lines.append(
                f"{set_name} ({protocol}): {len(ok)} runs, {within} within "
                f"±{100 * TOLERANCE:.0f}%, worst {100 * worst['error_total']:+.2f}% "
                f"({worst['arch']} L{worst['layers']} b{worst['batch']} s{worst['seq_len']} "
                f"gc={int(worst['grad_checkpointing'])} {worst['loop']}); {covered} within the "
                f"estimate plus its margin; {counted} within what the verdict counts; "
                f"{failed} failed"
            )
    return "\n".join(lines)


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--measured",
        action="append",
        default=None,
        help="a results JSONL (repeatable); default: tests/fixtures/memory/results.jsonl and "
        "issue39.jsonl",
    )
    ap.add_argument(
        "--write", metavar="DIR", default=None, help="write comparison.{json,csv,md} there"
    )
    args = ap.parse_args(argv)
    paths = (
        [Path(p) for p in args.measured]
        if args.measured
        else [MEASURED / "results.jsonl", MEASURED / "issue39.jsonl"]
    )
    table: list[dict[str, Any]] = []
    for path in paths:
        table += rows(path)
    text = render(table)
    print(text)
    if args.write:
        out = Path(args.write)
        out.mkdir(parents=True, exist_ok=True)
        _write_atomic(out / "comparison.json", json.dumps(table, indent=1) + "\n")
        _write_atomic(out / "comparison.md", text + "\n")
        fields = sorted({k for r in table for k in r})
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=fields)
        writer.writeheader()
        writer.writerows(table)
        _write_atomic(out / "comparison.csv", buf.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
