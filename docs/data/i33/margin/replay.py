"""auto's decision rule replayed on recorded sweeps, for several margins.

Every model-check sweep (``docs/data/i33/model/*/``: ``bench allreduce`` with
``onebit``, ``topk``, ``terngrad`` through ``twoshot``, ``allgather`` and
``auto``, next to ``MPI_Allreduce`` and ``none``+``mpi``, with the profile
calibrated for it) holds, per codec and size, the measured time of each
choice ``auto`` has: dense (the ``none``+``mpi`` row: the same lean
``MPI_Allreduce`` through the reducer), ``twoshot`` and ``allgather``.  The
profile gives what the cost model predicted for each.  For a margin ``m``
the rule picks dense unless a compressed choice is predicted faster than
dense by the factor ``1 / (1 - m)`` (:data:`hpccomm.collectives.auto.MARGIN`
is the ``m`` in use), and the measured time of the pick is then compared with
the best of the three and with the bare ``MPI_Allreduce`` of the same sweep.

At ``m`` = the margin in use the replay must pick what ``auto`` picked in the
sweep (its ``auto`` rows); the count of agreements is printed per directory
(a sweep of code older than the current model may differ).

    python docs/data/i33/margin/replay.py [DIR ...]      (default: every model run)
"""
import glob
import json
import math
import os
import sys

import hpccomm
from hpccomm import cost_model
from hpccomm.collectives.auto import CHOICES, MARGIN

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(HERE, "..", "model")
MARGINS = (0.0, 0.05, MARGIN, 0.15, 0.2, 0.25, 0.3, 0.4)


def points(directory):
    """``(net, P, codec, size, measured, predicted, mpi, recorded)`` per
    codec and size of every sweep in ``directory`` with its profile."""
    for path in sorted(glob.glob(os.path.join(directory, "*-p[0-9].json"))):
        run = os.path.basename(path)[:-5]
        profile = os.path.join(directory, f"profile-{run}.json")
        if not os.path.exists(profile):
            continue
        model = cost_model.CostModel(cost_model.load(profile)[0])
        data = json.load(open(path, encoding="utf-8"))
        P = int(data["meta"]["ranks"])
        rows = {}
        for r in data["rows"]:
            rows[r["size"], r["codec_name"], r["algorithm_name"]] = r
        for (size, codec, alg), r in rows.items():
            if alg != "auto":
                continue
            dense, two, ag = (rows.get((size, "none", "mpi")), rows.get((size, codec, "twoshot")),
                              rows.get((size, codec, "allgather")))
            bare = rows.get((size, "-", "MPI_Allreduce"))
            if None in (dense, two, ag, bare):
                continue
            n = int(r["count"])
            shape = (n // 1024, 1024) if n % 1024 == 0 and n >= 1024 else (n,)
            c = hpccomm.get_codec(codec)
            predicted = {"dense": model.dense(n),
                         "twoshot": cost_model.predict(model, c, "twoshot", n, P, shape,
                                                       int(two.get("segments", 1))),
                         "allgather": cost_model.predict(model, c, "allgather", n, P, shape)}
            measured = {"dense": dense["time_median"], "twoshot": two["time_median"],
                        "allgather": ag["time_median"]}
            yield (run.split("-")[0], P, codec, size, measured, predicted,
                   bare["time_median"], r.get("auto_choice"))


def pick(predicted, margin):
    scored = {c: t if c == "dense" else t / (1 - margin) for c, t in predicted.items()}
    return min(scored, key=lambda c: (scored[c], CHOICES.index(c)))


def main(dirs):
    pts = []
    for d in dirs:
        found = list(points(d))
        agree = sum(pick(p[5], MARGIN) == p[7] for p in found)
        print(f"# {os.path.relpath(d, MODEL)}: {len(found)} points; the replay at m = {MARGIN} "
              f"picks what auto picked at {agree}")
        pts += found
    big = [p for p in pts if p[3] >= 64 << 10]
    print(f"\n{len(pts)} points ({len(big)} from 64 KiB); per margin: the pick within 5 % of "
          "the best of dense / twoshot / allgather; at >= 0.95x MPI_Allreduce (from 64 KiB); "
          "geometric means of best / pick and of MPI_Allreduce / pick\n")
    nets = sorted({p[0] for p in pts}, key=["shm", "1gbit", "4gbit"].index)
    head = "| margin | " + " | ".join(f"{net}: within 5 % / >= 0.95x MPI / regret / speedup"
                                       for net in nets) + " | all: within 5 % / >= 0.95x MPI |"
    print(head)
    print("|---:|" + "---|" * (len(nets) + 1))
    for m in MARGINS:
        cells = []
        tot_best = tot_mpi = tot_n = tot_big = 0
        for net in nets:
            sel = [p for p in pts if p[0] == net]
            best = mpi_ok = 0
            regret = speed = 0.0
            nbig = 0
            for _, _, _, size, meas, pred, bare, _ in sel:
                t = meas[pick(pred, m)]
                best += t <= 1.05 * min(meas.values())
                regret += math.log(t / min(meas.values()))
                speed += math.log(bare / t)
                if size >= 64 << 10:
                    nbig += 1
                    mpi_ok += bare / t >= 0.95
            cells.append(f"{best}/{len(sel)} / {mpi_ok}/{nbig} / {math.exp(regret / len(sel)):.3f}"
                         f" / {math.exp(speed / len(sel)):.2f}")
            tot_best, tot_mpi, tot_n, tot_big = tot_best + best, tot_mpi + mpi_ok, tot_n + len(sel), tot_big + nbig
        print(f"| {m:.2f}{' (in use)' if m == MARGIN else ''} | " + " | ".join(cells)
              + f" | {tot_best}/{tot_n} ({100 * tot_best / tot_n:.1f} %) / {tot_mpi}/{tot_big} "
              f"({100 * tot_mpi / tot_big:.1f} %) |")


if __name__ == "__main__":
    dirs = sys.argv[1:] or sorted({os.path.dirname(p) for p in
                                   glob.glob(os.path.join(MODEL, "**", "profile-*.json"),
                                             recursive=True)})
    main([os.path.abspath(d) for d in dirs])
