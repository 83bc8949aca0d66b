"""``python -m hpccomm.bench report FILE.json [--rate 1gbit] [--pivot]``: a
markdown table of ``hpccomm.bench allreduce`` results, each measured time next
to the model's floor (``--pivot``: a case x size grid of times and speedups).

The floor of a case is the time its bytes need on the link plus the kernel
time measured in the same run::

    floor = wire_bytes * 8 / rate + t_encode + t_decode

and for a call pipelined in ``S > 1`` segments (the row's ``segments``),
where the wire works while the kernels run::

    floor = max(wire, kernels) + min(wire, kernels) / S

(the longer of the two, plus one segment of the shorter to fill and drain
the pipeline).
``wire_bytes`` is what the busiest rank sent in one call (the row's
``wire(B)``), ``t_encode`` / ``t_decode`` the medians of the slowest rank.
On a per-host emulated network every rank's NIC carries its own bytes at
``rate`` in each direction, so the bytes a rank sends bound the time from
below.  For ``MPI_Allreduce`` the row's bytes are the ring algorithm's
``2 (P-1)/P`` times the input and its kernel time is 0.  Without ``--rate``
(shared memory) only the kernel part is given: the floor is then the
computation that no transport can hide.

``measured / floor`` shows the gap: near 1 the case is at its model's limit;
far above it, something the model leaves out (latency, protocol rounds,
scheduling of more ranks than cores, memory traffic outside the kernels)
dominates.
"""
from __future__ import annotations

import argparse
import json
import sys

from .netem import parse_rate, rate_bits


def fmt_time(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def fmt_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _num(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def floor_seconds(row: dict, bits_per_second) -> float:
    kernels = float(row.get("t_encode", 0.0)) + float(row.get("t_decode", 0.0))
    if bits_per_second is None:
        return kernels
    wire = int(row["wire_bytes"]) * 8 / bits_per_second
    segments = int(row.get("segments", 1))
    if segments > 1:
        return max(wire, kernels) + min(wire, kernels) / segments
    return wire + kernels


def table(data: dict, rate=None, sizes=None) -> str:
    bps = rate_bits(rate) if rate else None
    rows = [r for r in data["rows"] if sizes is None or r["size"] in sizes]
    head = ["size", "case", "median", "speedup vs MPI", "wire B/rank", "ratio",
            "rel. error", "floor", "measured / floor"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        case = ("MPI_Allreduce" if r["algorithm_name"] == "MPI_Allreduce"
                else f"{r['codec_name']}+{r['algorithm_name']}")
        if int(r.get("segments", 1)) > 1:
            case += f" ({r['segments']} segments)"
        floor = floor_seconds(r, bps)
        gap = f"{r['time_median'] / floor:.1f}" if floor > 0 else "–"
        lines.append("| " + " | ".join([
            fmt_size(r["size"]), case, fmt_time(r["time_median"]), _num(r.get("speedup"), ".2f"),
            f"{int(r['wire_bytes']):,}", _num(r.get("ratio"), ".1f"), _num(r.get("rel_err"), ".2g"),
            fmt_time(floor) if floor > 0 else "–", gap]) + " |")
    return "\n".join(lines)


def pivot(data: dict, sizes=None) -> str:
    """Median time per case (rows) and size (columns), the speedup over
    ``MPI_Allreduce`` in parentheses."""
    rows = [r for r in data["rows"] if sizes is None or r["size"] in sizes]
    all_sizes = sorted({r["size"] for r in rows})
    cases, cells = [], {}
    for r in rows:
        case = ("MPI_Allreduce" if r["algorithm_name"] == "MPI_Allreduce"
                else f"{r['codec_name']}+{r['algorithm_name']}")
        if int(r.get("segments", 1)) > 1:
            case += f" ({r['segments']} segments)"
        if case not in cases:
            cases.append(case)
        cells[case, r["size"]] = (f"{fmt_time(r['time_median'])}" if case == "MPI_Allreduce"
                                  else f"{fmt_time(r['time_median'])} ({r['speedup']:.2f}×)")
    lines = ["| case | " + " | ".join(fmt_size(s) for s in all_sizes) + " |",
             "|" + "---|" * (len(all_sizes) + 1)]
    for case in cases:
        lines.append(f"| {case} | " + " | ".join(cells.get((case, s), "–") for s in all_sizes)
                     + " |")
    return "\n".join(lines)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m hpccomm.bench report",
                                description="Markdown table of allreduce JSON results with "
                                            "the model's floor next to each time.")
    p.add_argument("file", help="JSON written by 'hpccomm.bench allreduce -J'")
    p.add_argument("--rate", type=parse_rate, default=None,
                   help="link rate of the run (e.g. 1gbit) for the floor's wire term; "
                        "omit for shared memory")
    p.add_argument("--pivot", action="store_true",
                   help="one row per case, one column per size: median time and speedup")
    p.add_argument("--sizes", default=None,
                   help="comma-separated sizes in bytes to include (default: all)")
    p.add_argument("--profile", default=None,
                   help="a calibration profile: one row per case with the cost model's "
                        "prediction next to the measured time (auto's model, validated)")
    return p


def predicted(data: dict, profile_file: str, sizes=None) -> str:
    """Every row's measured time next to what the cost model of
    ``profile_file`` predicts for it, and the share of rows within 20 %."""
    import hpccomm
    from hpccomm import cost_model

    profile, _ = cost_model.load(profile_file)
    model = cost_model.CostModel(profile)
    P = int(data.get("meta", {}).get("ranks", 1))
    head = ["size", "case", "measured", "predicted", "predicted / measured"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    within = total = 0
    for r in data["rows"]:
        if sizes is not None and r["size"] not in sizes:
            continue
        alg = r["algorithm_name"]
        n = int(r["count"])
        shape = (n // 1024, 1024) if n % 1024 == 0 and n >= 1024 else (n,)
        codec = hpccomm.get_codec(r["codec_name"]) if r["codec_name"] != "-" else None
        if alg == "auto" or (codec is None and alg != "MPI_Allreduce"):
            continue
        t = cost_model.predict(model, codec, alg, n, P, shape, int(r.get("segments", 1)))
        if t is None:
            continue
        ratio = t / r["time_median"]
        total += 1
        within += abs(ratio - 1) <= 0.2
        case = "MPI_Allreduce" if alg == "MPI_Allreduce" else f"{r['codec_name']}+{alg}"
        lines.append(f"| {fmt_size(r['size'])} | {case} | {fmt_time(r['time_median'])} | "
                     f"{fmt_time(t)} | {ratio:.2f} |")
    lines.append("")
    lines.append(f"{within} of {total} predictions within 20 % of the measured time")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    with open(args.file, encoding="utf-8") as f:
        data = json.load(f)
    if "rows" not in data:
        raise SystemExit(f"{args.file}: not an allreduce result (no 'rows')")
    sizes = None if args.sizes is None else {int(s) for s in args.sizes.split(",")}
    meta = data.get("meta", {})
    print(f"<!-- {args.file}: {meta.get('ranks', '?')} ranks, {meta.get('mpi', '')}, "
          f"{meta.get('date', '')}{', ' + args.rate if args.rate else ''} -->")
    if args.profile:
        print(predicted(data, args.profile, sizes))
    else:
        print(pivot(data, sizes) if args.pivot else table(data, args.rate, sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
