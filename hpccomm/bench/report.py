"""``python -m hpccomm.bench report FILE.json [--rate 1gbit] [--pivot |
--profile P.json]``: a markdown table of ``hpccomm.bench allreduce`` results,
each measured time next to the model's floor (``--pivot``: a case x size grid
of times and speedups; ``--profile``: next to the cost model's prediction, see
:func:`predicted`).

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


#: the terms of a prediction and what each stands for in a measured call
TERMS = {"overhead": "per-call Python", "kernels": "kernels", "comm": "MPI"}
#: a prediction off the measured time by more than this is an outlier
TOLERANCE = 0.2


def measured_terms(row: dict) -> dict:
    """The measured call split like a prediction: ``kernels`` (the slowest
    rank's encode + decode phases), ``comm`` (its time in MPI calls) and
    ``overhead`` (the rest of the median call)."""
    kernels = float(row.get("t_encode", 0.0)) + float(row.get("t_decode", 0.0))
    comm = float(row.get("t_comm", 0.0))
    return {"overhead": max(float(row["time_median"]) - kernels - comm, 0.0),
            "kernels": kernels, "comm": comm}


def ranks_per_core(meta: dict) -> float:
    """Ranks on the busiest host over its cores (1 when the run did not say)."""
    hosts, cores = meta.get("hosts") or [], meta.get("cores")
    if not hosts or not cores:
        return 1.0
    return max(hosts.count(h) for h in set(hosts)) / cores


def cause(predicted_terms: dict, row: dict, notes=()) -> str:
    """Why a prediction misses: the term whose predicted time is furthest from
    the measured one, with both, then what the run says about that term."""
    measured = measured_terms(row)
    term = max(TERMS, key=lambda t: (abs(predicted_terms[t] - measured[t]), -list(TERMS).index(t)))
    p, m = predicted_terms[term], measured[term]
    text = (f"{TERMS[term]} {'over' if p > m else 'under'}-predicted: "
            f"{fmt_time(p)} predicted, {fmt_time(m)} measured")
    return "; ".join([text, *notes])


def _row_case(r: dict) -> tuple:
    """``(algorithm to predict, case label)`` of a result row; auto's rows are
    predicted as the algorithm it chose."""
    alg = r["algorithm_name"]
    case = "MPI_Allreduce" if alg == "MPI_Allreduce" else f"{r['codec_name']}+{alg}"
    if alg == "auto":
        alg = r.get("auto_choice") or "auto"
        case += f" ({alg})"
    return alg, case


def _bare_ratios(rows, model, P: int) -> dict:
    """``{size: predicted / measured}`` of each size's bare ``MPI_Allreduce``
    row: how far the machine's MPI at that point of the sweep was from the
    calibration the predictions start from."""
    from hpccomm import cost_model

    out = {}
    for r in rows:
        if r["algorithm_name"] == "MPI_Allreduce" and r["time_median"] > 0:
            n = int(r["count"])
            terms = cost_model.predict_terms(model, None, "MPI_Allreduce", n, P, (n,), 1)
            if terms is not None:
                out[r["size"]] = sum(terms.values()) / r["time_median"]
    return out


def predicted(data: dict, profile_file: str, sizes=None) -> str:
    """Every row's measured time next to what the cost model of
    ``profile_file`` predicts for it, term by term; the share of rows within
    20 %, over all rows and over the sizes whose bare ``MPI_Allreduce`` the
    profile predicts within 20 % (where the machine's MPI ran as when it was
    calibrated); then every outlier with its cause, and, at the other
    sizes, how far that bare call was off."""
    import hpccomm
    from hpccomm import cost_model

    profile, _ = cost_model.load(profile_file)
    model = cost_model.CostModel(profile)
    meta = data.get("meta", {})
    P = int(meta.get("ranks", 1))
    shared = ranks_per_core(meta)
    ladder = [b for b, _ in profile["patterns"]["alltoallv"]]
    head = ["size", "case", "measured", "predicted", "predicted / measured",
            "predicted: Python / kernels / MPI", "measured: Python / kernels / MPI"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    within = total = 0
    steady_within = steady_total = 0
    outliers = []
    bare = _bare_ratios([r for r in data["rows"] if sizes is None or r["size"] in sizes],
                        model, P)
    for r in data["rows"]:
        if sizes is not None and r["size"] not in sizes:
            continue
        alg, case = _row_case(r)
        n = int(r["count"])
        shape = (n // 1024, 1024) if n % 1024 == 0 and n >= 1024 else (n,)
        codec = hpccomm.get_codec(r["codec_name"]) if r["codec_name"] != "-" else None
        if codec is None and alg != "MPI_Allreduce":
            continue
        segments = int(r.get("segments", 1))
        terms = cost_model.predict_terms(model, codec, alg, n, P, shape, segments)
        if terms is None:
            continue
        t = sum(terms.values())
        ratio = t / r["time_median"]
        total += 1
        within += abs(ratio - 1) <= TOLERANCE
        drift = bare.get(r["size"])
        if drift is not None and abs(drift - 1) <= TOLERANCE:
            steady_total += 1
            steady_within += abs(ratio - 1) <= TOLERANCE
        m = measured_terms(r)
        lines.append(f"| {fmt_size(r['size'])} | {case} | {fmt_time(r['time_median'])} | "
                     f"{fmt_time(t)} | {ratio:.2f} | "
                     + " / ".join(fmt_time(terms[k]) for k in TERMS) + " | "
                     + " / ".join(fmt_time(m[k]) for k in TERMS) + " |")
        if abs(ratio - 1) > TOLERANCE:
            notes = []
            if shared > 1:
                notes.append(f"{shared:g} ranks per core")
            if segments > 1:
                notes.append(f"{segments} segments: transfers overlap the kernels")
            wire = int(r.get("wire_bytes", 0))
            if alg not in ("MPI_Allreduce", "mpi", "dense") and wire > ladder[-1] * (P - 1):
                notes.append("beyond the calibrated message sizes")
            if alg != "MPI_Allreduce" and drift is not None and abs(drift - 1) > TOLERANCE:
                notes.append(f"this size's bare MPI_Allreduce: {drift:.2f}")
            outliers.append(f"- {fmt_size(r['size'])} {case}: {ratio:.2f}; "
                            + cause(terms, r, notes))
    lines.append("")
    lines.append(f"{within} of {total} predictions within {TOLERANCE * 100:.0f} % of the measured time")
    if bare:
        steady = sum(abs(d - 1) <= TOLERANCE for d in bare.values())
        lines.append(f"At the {steady} of {len(bare)} sizes whose bare MPI_Allreduce the profile "
                     f"predicts within {TOLERANCE * 100:.0f} %: {steady_within} of {steady_total}")
    if outliers:
        lines += ["", f"Outliers ({len(outliers)}), predicted / measured and the term that "
                      "misses most:", *outliers]
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
