"""Sparse allreduce algorithms against a dense ``MPI_Allreduce`` of the same length.

    mpiexec -n P python -m mpi4py -m hpccomm.bench.sparse_allreduce [-n 16M] [-d 0.001,0.01,0.1]

Every rank draws ``round(density * n)`` distinct random indices (uniform over
``[0, n)``, seeded by rank) with N(0, 1) values and calls
:func:`hpccomm.sparse_allreduce` (dense result) with each algorithm; the
baseline is ``comm.Allreduce`` of the same vector stored densely.  Timing:
``Barrier; t0; call; t1`` per iteration; an iteration's time is the slowest
rank's, the table shows the median over the timed iterations.  ``sent`` is
the bytes this rank handed to MPI per call (the MAX over ranks; modelled for
``MPI_Allreduce`` -- ``2 (P-1)/P 4 n`` -- and for ``sparse_op``, marked
``*``).  ``kylix`` runs with a fresh state each call (index sets that change
every step, configuration included); ``kylix+cache`` keeps its state (the
routing configuration is reused, values only).  Each algorithm's result is
checked once against the exact float64 sum (``rel_err``).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from .harness import slowest_median

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_count(text: str) -> int:
    """'16M' -> 16 * 2**20 elements."""
    t = text.strip().lower()
    unit = t[-1] if t and t[-1] in "kmg" else ""
    try:
        value = float(t[:-1] if unit else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a length: {text!r} (use e.g. 4096, 64K, 16M)")
    if value < 0:
        raise argparse.ArgumentTypeError(f"negative length {text!r}")
    return int(value * _UNITS[unit])


def parse_densities(text: str):
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of densities: {text!r}")
    if not values or any(not 0 <= v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"densities must be in [0, 1]: {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpccomm.bench.sparse_allreduce",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--length", type=parse_count, default=16 << 20,
                   help="vector length in float32 elements (K, M, G = 2**10, 2**20, 2**30; "
                        "default 16M)")
    p.add_argument("-d", "--densities", type=parse_densities, default=[0.001, 0.01, 0.1],
                   help="comma-separated input densities per rank (default 0.001,0.01,0.1)")
    p.add_argument("-a", "--algorithms", default=None,
                   help="comma-separated sparse algorithms (default: all, plus kylix+cache)")
    p.add_argument("-i", "--iterations", type=int, default=5, help="timed iterations (default 5)")
    p.add_argument("-x", "--warmup", type=int, default=1, help="untimed iterations (default 1)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.warmup < 0:     # the same argv, so every rank exits
        parser.error("--iterations must be at least 1 and --warmup at least 0")
    import numba
    from mpi4py import MPI

    import hpccomm
    from hpccomm.state import KeyState

    numba.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n = args.length
    algorithms = (args.algorithms.split(",") if args.algorithms
                  else list(hpccomm.sparse_algorithms()) + ["kylix+cache"])
    known = set(hpccomm.sparse_algorithms()) | {"kylix+cache"}
    bad = [a for a in algorithms if a not in known]
    if bad:
        raise SystemExit(f"unknown sparse algorithm(s) {bad}; available: {sorted(known)}")
    if rank == 0:
        print(f"# hpccomm sparse allreduce benchmark: n={n} float32, ranks={size}, "
              f"median of {args.iterations} (slowest rank per iteration)")
        print(f"# MPI: {MPI.Get_library_version().splitlines()[0].strip()}")
        print(f"{'density':>8} {'algorithm':>17} {'time(ms)':>10} {'vs dense':>9} "
              f"{'sent(MiB)':>11} {'rel_err':>9}  extra")
        sys.stdout.flush()
    for density in args.densities:
        rng = np.random.default_rng([args.seed, rank, n])
        k = int(round(density * n))
        idx = np.sort(rng.choice(n, size=k, replace=False)) if k else np.empty(0, np.int64)
        sv = hpccomm.SparseVector(idx, rng.standard_normal(k).astype(np.float32), n)
        dense_in = sv.to_dense()
        exact = np.zeros(n, np.float64)
        for r_idx, r_vals in comm.allgather((sv.indices, sv.values)):
            exact[r_idx] += r_vals
        norm = float(np.linalg.norm(exact)) or 1.0
        dense_out = np.empty_like(dense_in)
        result = np.empty_like(dense_in)
        t_dense = slowest_median(comm, lambda: comm.Allreduce(dense_in, dense_out, op=MPI.SUM),
                                 args.iterations, warmup=args.warmup)
        rows = [("MPI_Allreduce", t_dense, 2 * (size - 1) * 4 * n // size if size > 1 else 0,
                 True, float(np.linalg.norm(dense_out - exact)) / norm, "")]
        for alg in algorithms:
            name = "kylix" if alg == "kylix+cache" else alg
            kept = KeyState() if alg == "kylix+cache" else None
            last = {}

            def call():
                last["stats"] = hpccomm.CallStats()
                last["result"] = hpccomm.sparse_allreduce(
                    sv, comm, algorithm=name, out=result, stats=last["stats"],
                    state=kept if kept is not None else KeyState())

            t = slowest_median(comm, call, args.iterations, warmup=args.warmup)
            stats, res = last["stats"], last["result"]
            sent = comm.allreduce(stats.bytes_sent, op=MPI.MAX)
            err = float(np.linalg.norm(res - exact)) / norm
            extra = {k: v for k, v in stats.extra.items()
                     if k in ("went_dense", "degrees", "config_cached", "record_bytes")}
            rows.append((alg, t, sent, stats.modelled, err, extra))
        if rank == 0:
            for alg, t, sent, modelled, err, extra in rows:
                mark = "*" if modelled else " "
                text = " ".join(f"{k}={v}" for k, v in extra.items()) if extra else ""
                print(f"{density:>8g} {alg:>17} {t * 1e3:>10.2f} {t_dense / t:>8.2f}x "
                      f"{sent / 2**20:>10.3f}{mark} {err:>9.1e}  {text}")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
