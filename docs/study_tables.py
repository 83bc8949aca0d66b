"""Markdown tables of the accuracy study (docs/results/accuracy.md) from the
JSON files that docs/data/i35/study.sh (and the older docs/data/i18/study.sh) write:
mean ± sample standard deviation over the seeds.

    python docs/study_tables.py docs/data/i35
"""
import json
import math
import os
import sys

import numpy as np

MODELS = [("mlp", "digits MLP, test accuracy (%)"), ("cnn", "MNIST-1D CNN, test accuracy (%)"),
          ("charlm", "char transformer, final validation loss (bits/char; the target's metric)")]


def metric(r, loss):
    """Test accuracy, or the final validation loss (the language target's metric)."""
    if loss:
        return math.inf if r["diverged_at_step"] is not None else r["history"][-1]["val"]
    return 0.0 if r["test"] is None else r["test"]


def load(path):
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return json.load(f)["runs"]


def cell(runs, label, base, loss):
    mine = [r for r in runs if r["label"] == label]
    if not mine:
        return "–"
    if loss:
        v = np.array([metric(r, True) for r in mine])
        d = f" ({100 * (v.mean() / base - 1):+.1f} %)" if base and label != "none" else ""
        return f"{v.mean():.3f} ± {v.std(ddof=1):.3f}{d}" if np.isfinite(v).all() else \
            f"{int((~np.isfinite(v)).sum())}/{len(v)} diverged"
    v = 100 * np.array([metric(r, False) for r in mine])
    d = f" ({v.mean() - base:+.2f})" if base is not None and label != "none" else ""
    bad = sum(r["diverged_at_step"] is not None for r in mine)
    return f"{v.mean():.2f} ± {v.std(ddof=1):.2f}{d}" + (f" [{bad} div.]" if bad else "")


def main(folder):
    for model, title in MODELS:
        loss = model == "charlm"
        print(f"\n{title}, P = 4, seeds 0,1,2 (difference to fp32 in brackets)\n")
        print("| codec | (a) same hyper-parameters | (b) paper recipe + chosen lr |")
        print("|---|---|---|")
        cols = []
        for recipe in ("same", "paper"):
            runs = load(os.path.join(folder, f"{model}-{recipe}.json")) + \
                load(os.path.join(folder, f"{model}-{recipe}-noef.json"))
            fp32 = [r for r in runs if r["label"] == "none"]
            base = (np.mean([metric(r, loss) for r in fp32]) * (1 if loss else 100)
                    if fp32 else None)
            cols.append((runs, base))
        labels = list(dict.fromkeys(r["label"] for runs, _ in cols for r in runs))
        for label in labels:
            print(f"| {label} | " + " | ".join(cell(runs, label, base, loss)
                                               for runs, base in cols) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/data/i35")
