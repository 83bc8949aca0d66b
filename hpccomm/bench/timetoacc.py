"""``python -m hpccomm.bench tta FILE.json [...]``: time to accuracy from
``train -J`` results (e.g. runs across ``bench netem``), as a markdown table.

The target is fp32's final validation metric: the mean over seeds of the last
evaluation of the runs labelled ``none`` (fp32 through ``MPI_Allreduce``) in
the given files, less ``--tolerance`` (accuracy) or times ``1 + tolerance``
(loss); ``--target`` overrides it.  A run's time to accuracy is the
training clock (evaluation excluded) at its first evaluation that reaches the
target (accuracy >= target, loss <= target); per label the median over seeds
-- or, with ``--over-seeds curve``, the first evaluation at which the *mean
over seeds* of the validation metric reaches the target, at the seeds' mean
clock there (with a target taken from several seeds' mean, a seed below that
mean never reaches it, and the median then says "not reached" for the
reference itself).  Speed-ups are against ``none`` and, when present,
``ddp-powersgd``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from typing import Dict, List, Optional

import numpy as np


def reached(history: List[dict], target: float, loss: bool) -> Optional[float]:
    """The clock at the first evaluation that reaches ``target``, else None."""
    for e in history:
        if (e["val"] <= target) if loss else (e["val"] >= target):
            return float(e["time"])
    return None


def mean_curve(runs: List[dict]) -> List[dict]:
    """The seeds' histories averaged evaluation by evaluation (as far as the
    shortest goes): the mean metric at the mean clock."""
    n = min(len(r["history"]) for r in runs)
    return [{"val": float(np.mean([r["history"][k]["val"] for r in runs])),
             "time": float(np.mean([r["history"][k]["time"] for r in runs]))}
            for k in range(n)]


def table(runs: List[dict], loss: bool, target: Optional[float] = None,
          tolerance: float = 0.0, curve: bool = False) -> str:
    by: Dict[str, List[dict]] = defaultdict(list)
    for r in runs:
        by[r.get("label") or r["codec_name"]].append(r)
    source = "given"
    if target is None:
        source = "fp32's final" + (f", with tolerance {tolerance:g}" if tolerance else "")
        if "none" not in by:
            raise SystemExit("no fp32 ('none') runs to take the target from; give --target")
        target = float(np.mean([r["history"][-1]["val"] for r in by["none"]]))
        # the accuracy targets' own slack: pp below fp32, or a fraction above its loss
        target = target * (1 + tolerance) if loss else target - tolerance
    times = {}
    for label, rs in by.items():
        if curve:
            t = reached(mean_curve(rs), target, loss)
            times[label] = math.nan if t is None else t
            continue
        t = [reached(r["history"], target, loss) for r in rs]
        times[label] = (float(np.median([x for x in t])) if all(x is not None for x in t)
                        else math.nan)
    unit = "bits/char" if loss else "accuracy"
    out = [f"target: validation {unit} {target:.4f} ({source}); time to target: "
           + ("the seeds' mean curve" if curve else "median over seeds"), "",
           "| runs | seeds | final validation | final test | train time (s) | time to target (s) "
           "| vs fp32 MPI | vs DDP PowerSGD |", "|---|---|---|---|---|---|---|---|"]
    for label, rs in by.items():
        final = np.mean([r["history"][-1]["val"] if r["history"] else math.nan for r in rs])
        test = np.mean([math.nan if r["test"] is None else r["test"] for r in rs])
        train = np.median([r["history"][-1]["time"] if r["history"] else math.nan for r in rs])
        t = times[label]

        def ratio(ref):
            if ref not in times or math.isnan(t) or math.isnan(times[ref]):
                return "–"
            return f"{times[ref] / t:.2f}×"

        out.append(f"| {label} | {len(rs)} | {final:.4f} | {test:.4f} | {train:.1f} | "
                   f"{'not reached' if math.isnan(t) else f'{t:.1f}'} | {ratio('none')} | "
                   f"{ratio('ddp-powersgd')} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpccomm.bench tta",
                                description="Time to accuracy from train JSON results.")
    p.add_argument("files", nargs="+")
    p.add_argument("--target", type=float, default=None,
                   help="validation metric to reach (default: fp32's final, mean over seeds)")
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="with the default target: accept this much less accuracy (0.005: "
                        "0.5 pp) or this fraction more loss (0.02: 2 %%)")
    p.add_argument("--over-seeds", choices=("median", "curve"), default="median",
                   help="time to target per label: the median of the seeds' times, or "
                        "where the seeds' mean validation curve reaches the target")
    args = p.parse_args(argv)
    runs, metrics = [], set()
    for path in args.files:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        metrics.add(data["meta"].get("metric", "accuracy"))
        runs.extend(data["runs"])
    if len(metrics) != 1:
        raise SystemExit(f"files mix metrics {sorted(metrics)}")
    print(table(runs, metrics.pop() == "loss", args.target, args.tolerance,
                args.over_seeds == "curve"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
