"""The tables of docs/results/accuracy.md's meProp section, from the files that
accuracy.sh and bytes.sh write:

    python docs/data/i19/tables.py [docs/data/i19]
"""
import glob
import json
import os
import sys

import numpy as np


def runs(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)["runs"]


def accuracy(where):
    print("| meProp K (of 512) | test accuracy per seed (%) | mean | vs off | final train loss |")
    print("|---|---|---|---|---|")
    base = None
    for k in (0, 128, 64, 32, 16, 8):
        rs = [r for p in sorted(glob.glob(os.path.join(where, f"cnn-meprop-{k}*.json")))
              for r in runs(p)]
        if not rs:
            continue
        rs.sort(key=lambda r: r["seed"])
        test = np.array([100 * r["test"] for r in rs])
        base = test.mean() if k == 0 else base
        loss = np.mean([r["history"][-1]["train_loss"] for r in rs])
        print(f"| {k or 'off'} | {', '.join(f'{t:.2f}' for t in test)} (seeds "
              f"{','.join(str(r['seed']) for r in rs)}) | {test.mean():.2f} | "
              f"{test.mean() - base:+.2f} pp | {loss:.3f} |")


def wire(where):
    files = {int(os.path.basename(p)[6:-5]): p
             for p in glob.glob(os.path.join(where, "bytes-*.json"))}
    if not files:
        return
    order = sorted(files, key=lambda k: (k != 0, -k))
    summ = {k: json.load(open(files[k], encoding="utf-8"))["fc1_weight"]["summary"]
            for k in order}
    print()
    print("| meProp K | rows zero per rank | rows zero on every rank | non-zeros per rank |")
    print("|---|---|---|---|")
    for k, s in summ.items():
        print(f"| {k or 'off'} | {100 * s['rows_zero_rank']:.1f} % | "
              f"{100 * s['rows_zero_all']:.1f} % | {100 * s['density_rank']:.1f} % |")
    print()
    print("| MB per rank per step (`MPI_Allreduce` / it) | "
          + " | ".join(f"K {k or 'off'}" for k in order) + " |")
    print("|---" * (1 + len(order)) + "|")
    for a in summ[order[0]]["bytes_per_step"]:
        cells = []
        for k in order:
            b = summ[k]["bytes_per_step"]
            cells.append(f"{b[a] / 1e6:.3f}" + ("" if a == "MPI_Allreduce"
                                                else f" ({b['MPI_Allreduce'] / b[a]:.2f}×)"))
        print(f"| `{a}` | " + " | ".join(cells) + " |")
    same = []
    for k, p in files.items():
        probed = runs(p)[0]
        acc = [r for r in runs(os.path.join(where, f"cnn-meprop-{k}.json"))
               if r["seed"] == probed["seed"]]
        same.append(bool(acc) and acc[0]["digest"] == probed["digest"])
    print(f"\nthe probed runs' weights equal the accuracy runs' (same seed), bit for bit: "
          f"{all(same)}")
    worst = max(max(json.load(open(p, encoding="utf-8"))["fc1_weight"]["summary"]
                    ["max_rel_err"].values()) for p in files.values())
    print(f"largest relative error of a sparse sum against the exact one: {worst:.1e}")


def harness(where):
    paths = sorted(glob.glob(os.path.join(where, "harness-*.json")))
    if not paths:
        return
    print()
    print("| run | test accuracy | MB per rank per step (whole model) |")
    print("|---|---|---|")
    for p in paths:
        for r in runs(p):
            print(f"| `{r['algorithm']}`, meProp {r['meprop']}, seed {r['seed']} | "
                  f"{100 * r['test']:.2f} % | {r['bytes_sent_per_rank'] / r['steps'] / 1e6:.3f} |")


if __name__ == "__main__":
    where = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    accuracy(where)
    wire(where)
    harness(where)
