"""Tables of docs/results/accuracy.md's "Bounded staleness: accuracy" from
docs/data/i19's JSON: the validation grid (S x momentum x lr, seed 100), its
choice per codec and S (bench lrgrid's rule: the best final validation
accuracy, ties to the smaller rate), and the test accuracy over seeds 0,1,2.

    python docs/data/i19/staleness_tables.py
"""
import glob
import json
import os
import re

import numpy as np

from hpccomm.bench.lrgrid import score

HERE = os.path.dirname(os.path.abspath(__file__))


def runs(pattern):
    out = []
    for path in sorted(glob.glob(os.path.join(HERE, pattern))):
        with open(path) as f:
            data = json.load(f)
        m = re.search(r"-m([\d.]+)-lr([\d.]+)\.json$", path)
        for r in data["runs"]:
            r["momentum"] = float(m.group(1)) if m else 0.9
            out.append(r)
    return out


def grid():
    rows, chosen = [], {}
    cells = {}
    for r in runs("grid-cnn-s*-m*-lr*.json"):
        key = (r["codec_name"], r["staleness"])
        cells.setdefault(key, {})[(r["momentum"], r["lr"])] = score(r, "accuracy")
    print("| codec | S | " + " | ".join(f"m {m}, lr {lr}" for m in (0.9, 0.5)
                                        for lr in (0.025, 0.0125, 0.00625)) + " | chosen |")
    print("|---" * 9 + "|")
    for key in sorted(cells):
        c = cells[key]
        best = max(sorted(c), key=lambda ml: (c[ml], -ml[1], ml[0]))
        chosen[key] = best
        vals = [c.get((m, lr), float("nan")) for m in (0.9, 0.5) for lr in (0.025, 0.0125, 0.00625)]
        print(f"| {key[0]} | {key[1]} | " + " | ".join(f"{100 * v:.1f}" for v in vals)
              + f" | m {best[0]}, lr {best[1]} |")
    return chosen


def accuracy(pattern, title):
    by = {}
    for r in runs(pattern):
        by.setdefault((r["label"]), []).append(r)
    print(f"\n{title}\n\n| run | test accuracy per seed (%) | mean | steps applied |")
    print("|---|---|---|---|")
    for label, rs in by.items():
        t = [0.0 if r["test"] is None else 100 * r["test"] for r in rs]
        print(f"| {label} | {', '.join(f'{x:.2f}' for x in t)} | {np.mean(t):.2f} "
              f"| {rs[0]['steps'] - rs[0].get('staleness', 0)} |")


if __name__ == "__main__":
    print(grid())
    for m in ("mlp", "cnn"):
        accuracy(f"acc-{m}-s[012].json", f"{m}, fp32's and terngrad's rates (protocol (b))")
    accuracy("acc-cnn-tuned-s[12]-*.json", "cnn, the grid's choice")
