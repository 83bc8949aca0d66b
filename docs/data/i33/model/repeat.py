"""How well this machine repeats the model check's sweep: two sweeps of the
same library code (their calibrations may differ; the sweeps do not depend on
them, save `auto`'s choice), matched by (codec, algorithm, size), and the share
of points where the two medians are within 20 % of each other -- a ceiling for
any model checked against one of them.  `auto` rows are compared only where
both sweeps chose the same algorithm.

    python docs/data/i33/model/repeat.py DIR_A DIR_B
"""
import json
import os
import sys

RUNS = [f"{net}-p{P}" for net in ("shm", "1gbit", "4gbit") for P in (2, 3, 4)]


def rows(path):
    got = {}
    for r in json.load(open(path))["rows"]:
        key = (r["codec_name"], r["algorithm_name"], r["size"])
        got[key] = (r["time_median"], r.get("auto_choice"))
    return got


def main(a, b):
    total = same = 0
    print("| run | points | within 20 % of each other |")
    print("|---|---:|---:|")
    for run in RUNS:
        ra, rb = rows(os.path.join(a, f"{run}.json")), rows(os.path.join(b, f"{run}.json"))
        n = k = 0
        for key in sorted(set(ra) & set(rb)):
            (ta, ca), (tb, cb) = ra[key], rb[key]
            if key[1] == "auto" and ca != cb:
                continue
            n += 1
            k += max(ta, tb) <= 1.2 * min(ta, tb)
        print(f"| {run} | {n} | {k} ({100 * k / n:.0f} %) |")
        total, same = total + n, same + k
    print(f"| all | {total} | {same} ({100 * same / total:.0f} %) |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
