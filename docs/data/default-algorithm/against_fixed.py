"""``auto`` against the best fixed choice of the same run, from a
``bench allreduce -J`` file: per codec and size, the best of dense through the
reducer (``none`` + ``mpi``), ``twoshot`` and ``allgather``, over ``auto``'s
time (1.0: as fast as the best; 0.95: 5 % slower).

    python docs/data/default-algorithm/against_fixed.py RUN.json [--min-bytes 65536]

Prints a markdown table (best fixed / auto, with auto's choice and the best
fixed algorithm) and the points below 0.95 from ``--min-bytes`` up.
"""
import argparse
import json


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run")
    ap.add_argument("--min-bytes", type=int, default=64 << 10)
    args = ap.parse_args()
    with open(args.run, encoding="utf-8") as f:
        rows = json.load(f)["rows"]
    dense = {r["size"]: r["time_median"] for r in rows
             if r["codec_name"] == "none" and r["algorithm_name"] == "mpi"}
    codecs = sorted({r["codec_name"] for r in rows if r["codec_name"] not in ("none", "-")})
    sizes = sorted({r["size"] for r in rows})
    print(f"# {args.run}: best fixed / auto (auto's choice; the best fixed choice)\n")
    print("| size | " + " | ".join(f"`{c}`" for c in codecs) + " |")
    print("|---:|" + "---:|" * len(codecs))
    misses, points = [], 0
    for size in sizes:
        cells = []
        for codec in codecs:
            mine = {r["algorithm_name"]: r for r in rows
                    if r["codec_name"] == codec and r["size"] == size}
            if "auto" not in mine:
                cells.append("-")
                continue
            fixed = {a: mine[a]["time_median"] for a in ("twoshot", "allgather") if a in mine}
            fixed["dense"] = dense[size]
            best = min(fixed, key=fixed.get)
            ratio = fixed[best] / mine["auto"]["time_median"]
            choice = mine["auto"].get("auto_choice") or "?"
            cells.append(f"{ratio:.2f} ({choice}; {best})")
            if size >= args.min_bytes:
                points += 1
                if ratio < 0.95:
                    misses.append(f"{codec} {size} B: {ratio:.2f} (auto {choice}, best {best})")
        print(f"| {size} | " + " | ".join(cells) + " |")
    print(f"\nfrom {args.min_bytes} B: {points - len(misses)} of {points} points within 5 % "
          "of the best fixed choice")
    for m in misses:
        print(f"- {m}")


if __name__ == "__main__":
    main()
