"""Estimate vs measured: `nybble.estimate_memory` against the peaks in results/measured.jsonl.

    python benchmarks/memory/compare.py            # table on stdout
    python benchmarks/memory/compare.py --write    # also results/comparison.{json,csv}

Each measured configuration (measure_peft_bnb.py, one fresh process per configuration on an
H100) is estimated with the same architecture, layer count, batch, sequence length,
gradient checkpointing, LoRA rank/dropout and optimizer. The error is
`(estimate - measured) / measured` of SPEC §5's figure (peak reserved over a steady-state step
plus the CUDA context); the allocated peak is compared as well.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def _import_memory() -> Any:
    try:
        from nybble import memory
    except ImportError:  # no compiled core here: the estimator itself is pure Python
        sys.path.insert(0, str(HERE.parents[1] / "python" / "nybble"))
        import memory  # type: ignore[no-redef]
    return memory


def estimate_for(rec: dict[str, Any]) -> Any:
    memory = _import_memory()
    preset = dict(memory.MODEL_PRESETS[rec["arch"]])
    preset["num_hidden_layers"] = rec["layers"]
    return memory.estimate_memory(
        preset,
        lora_r=rec.get("r", 16),
        lora_dropout=rec.get("dropout", 0.0),
        optimizer=rec.get("optim", "adamw"),
        batch=rec["batch"],
        seq_len=rec["seq"],
        grad_checkpointing=rec["gc"],
    )


def rows(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "error" in rec or "step2" not in rec:
            continue
        est = estimate_for(rec)
        measured = rec["step2"]["peak_reserved"] + rec["context_bytes"]
        alloc = rec["step2"]["peak_allocated"]
        extra = "".join(f" {k}={rec[k]}" for k in ("r", "dropout", "optim") if k in rec)
        out.append(
            dict(
                arch=rec["arch"],
                layers=rec["layers"],
                batch=rec["batch"],
                seq_len=rec["seq"],
                grad_checkpointing=rec["gc"],
                variant=extra.strip(),
                measured_total=measured,
                estimated_total=est.total_bytes,
                error_total=(est.total_bytes - measured) / measured,
                measured_allocated=alloc,
                estimated_allocated=est.allocated_peak_bytes,
                error_allocated=(est.allocated_peak_bytes - alloc) / alloc,
                measured_reserved=rec["step2"]["peak_reserved"],
                estimated_reserved=est.reserved_peak_bytes,
                context=rec["context_bytes"],
                peak_phase=est.peak_phase,
            )
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measured", default=str(RESULTS / "measured.jsonl"))
    ap.add_argument("--write", action="store_true", help="write results/comparison.{json,csv}")
    args = ap.parse_args()
    table = rows(Path(args.measured))
    gib = 2**30
    print(
        f"{'arch':>13} {'L':>3} {'b':>2} {'seq':>5} gc  {'measured':>9} {'estimate':>9} "
        f"{'err':>7}  {'alloc':>8} {'est':>8} {'err':>7}  peak phase"
    )
    for r in table:
        print(
            f"{r['arch']:>13} {r['layers']:>3} {r['batch']:>2} {r['seq_len']:>5} "
            f"{int(r['grad_checkpointing']):>2}  {r['measured_total'] / gib:9.3f} "
            f"{r['estimated_total'] / gib:9.3f} {100 * r['error_total']:+6.2f}%  "
            f"{r['measured_allocated'] / gib:8.3f} {r['estimated_allocated'] / gib:8.3f} "
            f"{100 * r['error_allocated']:+6.2f}%  {r['peak_phase']} {r['variant']}"
        )
    worst = max(table, key=lambda r: abs(r["error_total"]))
    worst_a = max(table, key=lambda r: abs(r["error_allocated"]))
    print(
        f"\n{len(table)} configurations; worst total error {100 * worst['error_total']:+.2f}% "
        f"({worst['arch']} L{worst['layers']} b{worst['batch']} s{worst['seq_len']} "
        f"gc={int(worst['grad_checkpointing'])}); worst allocated error "
        f"{100 * worst_a['error_allocated']:+.2f}%"
    )
    if args.write:
        (RESULTS / "comparison.json").write_text(json.dumps(table, indent=1) + "\n")
        with open(RESULTS / "comparison.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
