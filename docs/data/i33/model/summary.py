"""Counts of the model check: predictions within 20 % per run, the same
over the sizes whose bare MPI_Allreduce the profile predicts within 20 %
(where the machine's MPI ran as when it was calibrated), and the outliers
tallied by the term that misses most (from the *-predicted.md files that
run.sh writes).

    python docs/data/i33/model/summary.py [DIR]
"""
import collections
import glob
import os
import re
import sys

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
order = {"shm": 0, "1gbit": 1, "4gbit": 2}
files = sorted(glob.glob(os.path.join(here, "*-predicted.md")),
               key=lambda f: (order.get(os.path.basename(f).split("-")[0], 9), f))
within = total = steady_within = steady_total = 0
tally = collections.Counter()
print("| run | within 20 % | at the sizes where MPI ran as calibrated | "
      "outliers: term that misses most |")
print("|---|---:|---:|---|")
for f in files:
    text = open(f, encoding="utf-8").read()
    w, t = map(int, re.search(r"(\d+) of (\d+) predictions within", text).groups())
    within, total = within + w, total + t
    steady = re.search(r"At the (\d+) of (\d+) sizes [^:]*: (\d+) of (\d+)", text)
    if steady:
        sizes, of_sizes, sw, st = map(int, steady.groups())
        steady_within, steady_total = steady_within + sw, steady_total + st
        cell = f"{sw} of {st} ({100 * sw / max(st, 1):.1f} %; {sizes} of {of_sizes} sizes)"
    else:
        cell = "–"
    causes = collections.Counter(re.findall(
        r"^- [^;]*; ((?:per-call Python|kernels|MPI) (?:over|under))-predicted", text, re.M))
    tally.update(causes)
    run = os.path.basename(f)[:-len("-predicted.md")]
    print(f"| {run} | {w} of {t} ({100 * w / t:.1f} %) | {cell} | "
          + ", ".join(f"{k} {v}" for k, v in causes.most_common()) + " |")
steady_all = (f"{steady_within} of {steady_total} ({100 * steady_within / steady_total:.1f} %)"
              if steady_total else "–")
print(f"| all | {within} of {total} ({100 * within / total:.1f} %) | {steady_all} | "
      + ", ".join(f"{k} {v}" for k, v in tally.most_common()) + " |")
