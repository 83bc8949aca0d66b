"""MPI_Allreduce / auto per size and codec in each run of run.sh (the
choice named where auto compressed), then how far the two runs of each
order disagree: the median and largest |ratio of run 1 - ratio of run 2|.

    python docs/data/i33/interleave/ratios.py [DIR]
"""
import json
import os
import sys

d = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
runs = ["blocks-1", "interleaved-1", "blocks-2", "interleaved-2"]
data = {r: json.load(open(os.path.join(d, r + ".json")))["rows"] for r in runs if os.path.exists(os.path.join(d, r + ".json"))}
sizes = sorted({r["size"] for r in next(iter(data.values()))})
def fmt(b):
    return f"{b>>20} MiB" if b >= 1<<20 else f"{b>>10} KiB"
print("| size | MPI_Allreduce (µs) | " + " | ".join(f"{r}: onebit / topk" for r in data) + " |")
print("|---|---|" + "---|" * len(data))
for s in sizes:
    cells, mpis = [], []
    for r, rows in data.items():
        by = {(x["codec_name"], x["algorithm_name"]): x for x in rows if x["size"] == s}
        mpi = by[("-", "MPI_Allreduce")]["time_median"]
        mpis.append(f"{mpi*1e6:.0f}" if mpi < 1e-3 else f"{mpi*1e6:.0f}")
        c = []
        for codec in ("onebit", "topk"):
            row = by[(codec, "auto")]
            c.append(f"{mpi/row['time_median']:.2f}" + ("" if row["auto_choice"] == "dense" else f" ({row['auto_choice']})"))
        cells.append(" / ".join(c))
    print(f"| {fmt(s)} | {' / '.join(mpis)} | " + " | ".join(cells) + " |")

ratio = {}
for r, rows in data.items():
    by = {(x["size"], x["codec_name"], x["algorithm_name"]): x for x in rows}
    for s in sizes:
        for codec in ("onebit", "topk"):
            ratio[r, s, codec] = (by[s, "-", "MPI_Allreduce"]["time_median"]
                                  / by[s, codec, "auto"]["time_median"])
print()
for order in ("blocks", "interleaved"):
    diffs = sorted(abs(ratio[f"{order}-1", s, c] - ratio[f"{order}-2", s, c])
                   for s in sizes for c in ("onebit", "topk"))
    print(f"{order}: the two runs' ratios differ by {diffs[len(diffs) // 2]:.2f} (median) "
          f"and at most {diffs[-1]:.2f} over {len(diffs)} points")
