"""``python -m hpccomm.bench plot FILE.json [FILE.json ...]``: figures of
``hpccomm.bench allreduce`` results (needs matplotlib: ``pip install
'hpccomm[plot]'``).

For each input file, two PNGs beside it (or in ``--out``):

* ``<name>-time.png``: median time of the slowest rank against message size,
  one line per codec+algorithm, with ``MPI_Allreduce`` drawn thick and black;
  log-log axes.
* ``<name>-speedup.png``: speedup over ``MPI_Allreduce`` against size; the
  line at 1 is break-even.

Training results (``hpccomm.bench train -J``) give ``<name>-accuracy.png``:
the validation metric against epoch, mean over seeds with a min-max band, per
codec; and ``<name>-time.png``: the same against the training clock, with
fp32's final value as a line (time to accuracy).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict


def _label(row) -> str:
    if row["algorithm_name"] == "MPI_Allreduce":
        return "MPI_Allreduce"
    return f"{row['codec_name']}+{row['algorithm_name']}"


def _title(meta) -> str:
    return (f"{meta.get('ranks', '?')} ranks, {meta.get('mpi', '')}, "
            f"threads/rank {meta.get('threads', '?')}")


def _save(fig, ax, path: str, plt) -> str:
    """The legend outside the axes, then the PNG; returns its path."""
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_allreduce(data: dict, stem: str, plt) -> list:
    series = defaultdict(list)
    for row in data["rows"]:
        series[_label(row)].append(row)
    paths = []
    for kind, ylabel in (("time", "median time of the slowest rank (s)"),
                         ("speedup", "speedup over MPI_Allreduce")):
        fig, ax = plt.subplots(figsize=(10, 5.5))
        colors = plt.cm.tab20(range(20))
        for i, (label, rows) in enumerate(sorted(series.items(),
                                                 key=lambda kv: kv[0] != "MPI_Allreduce")):
            rows = sorted(rows, key=lambda r: r["size"])
            xs = [r["size"] for r in rows]
            ys = [r["time_median"] if kind == "time" else r["speedup"] for r in rows]
            base = label == "MPI_Allreduce"
            ax.plot(xs, ys, marker="o", markersize=3, label=label,
                    color="black" if base else colors[i % 20], linewidth=2.5 if base else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        if kind == "speedup":
            ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("message size (bytes of float32 input)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"allreduce {kind}: {_title(data.get('meta', {}))}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        paths.append(_save(fig, ax, f"{stem}-{kind}.png", plt))
    return paths


def _series(data: dict):
    """Runs grouped by label (codec, error feedback, runner) in first-seen order."""
    by = defaultdict(list)
    for run in data["runs"]:
        by[run.get("label") or run["codec_name"]].append(run)
    return by


def plot_train(data: dict, stem: str, plt) -> list:
    """``<stem>-accuracy.png``: the validation metric against epoch, mean over
    seeds with a min-max band; ``<stem>-time.png``: the same against the
    training clock (mean over seeds of each epoch's time), the horizontal
    line at fp32's final mean -- the time-to-accuracy picture."""
    import numpy as np

    meta = data.get("meta", {})
    loss = meta.get("metric") == "loss"
    colors = plt.cm.tab20(np.linspace(0, 1, 20))
    paths = []
    target = None
    series = _series(data)
    if "none" in series:
        target = np.mean([r["history"][-1]["val"] for r in series["none"] if r["history"]])
    for kind in ("accuracy", "time"):
        fig, ax = plt.subplots(figsize=(10, 5.5))
        for i, (label, runs) in enumerate(series.items()):
            # a diverged run stops early: its missing epochs count as chance (0) / no point
            length = max(len(r["history"]) for r in runs)
            if length == 0:
                continue
            val = np.full((len(runs), length), np.nan if loss else 0.0)
            clock = np.full((len(runs), length), np.nan)
            for j, r in enumerate(runs):
                val[j, :len(r["history"])] = [e["val"] for e in r["history"]]
                clock[j, :len(r["history"])] = [e["time"] for e in r["history"]]
            x = np.arange(1, length + 1) if kind == "accuracy" else np.nanmean(clock, axis=0)
            diverged = sum(r.get("diverged_at_step") is not None for r in runs)
            fp32 = label in ("none", "ddp-none")
            line, = ax.plot(x, np.nanmean(val, axis=0), marker="." if kind == "time" else None,
                            label=f"{label} (n={len(runs)}"
                                  f"{f', {diverged} diverged' if diverged else ''})",
                            color="black" if label == "none" else colors[i % 20],
                            linewidth=2.5 if fp32 else 1.2,
                            linestyle=":" if label.endswith("ef=off") else "-")
            if kind == "accuracy":
                ax.fill_between(x, np.nanmin(val, axis=0), np.nanmax(val, axis=0), alpha=0.10,
                                color=line.get_color())
        if target is not None and kind == "time":
            ax.axhline(target, color="black", linewidth=0.8, linestyle="--")
        ax.set_xlabel("epoch" if kind == "accuracy" else "training time (s)")
        ax.set_ylabel("validation " + ("loss (bits/char)" if loss else "accuracy"))
        where = meta.get("netem") or f"{meta.get('ranks', '?')} ranks"
        ax.set_title(f"{meta.get('model', '')} on {meta.get('dataset', '')}: {where}, "
                     f"recipe {meta.get('recipe', '')}", fontsize=10)
        ax.grid(True, alpha=0.3)
        paths.append(_save(fig, ax, f"{stem}-{kind}.png", plt))
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpccomm.bench plot",
                                description="PNG figures from benchmark JSON files.")
    p.add_argument("files", nargs="+", help="JSON written by 'allreduce -J' or 'train -J'")
    p.add_argument("--out", default=None, help="directory for the PNGs (default: beside input)")
    p.add_argument("--combine", default=None, metavar="NAME",
                   help="train results only: all runs of all files in one figure, "
                        "NAME-accuracy.png")
    args = p.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot needs matplotlib: pip install 'hpccomm[plot]'")
    if args.combine:
        merged = None
        for path in args.files:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            if "runs" not in data:
                raise SystemExit(f"{path}: --combine takes train results only")
            if merged is None:
                merged = {"meta": data.get("meta", {}), "runs": []}
            merged["runs"].extend(data["runs"])
        folder = args.out or os.path.dirname(os.path.abspath(args.files[0]))
        os.makedirs(folder, exist_ok=True)
        for w in plot_train(merged, os.path.join(folder, args.combine), plt):
            print(w)
        return 0
    for path in args.files:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        base = os.path.splitext(os.path.basename(path))[0]
        folder = args.out or os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        stem = os.path.join(folder, base)
        if "rows" in data:
            written = plot_allreduce(data, stem, plt)
        elif "runs" in data:
            written = plot_train(data, stem, plt)
        else:
            raise SystemExit(f"{path}: neither allreduce nor train results")
        for w in written:
            print(w)
    return 0


if __name__ == "__main__":
    sys.exit(main())
