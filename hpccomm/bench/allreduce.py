"""``python -m hpccomm.bench allreduce``: collectives against MPI_Allreduce.

Run under ``mpiexec -n P python -m mpi4py -m hpccomm.bench allreduce ...``.
Every run measures ``comm.Allreduce`` called directly on the same buffers as
the baseline (row ``MPI_Allreduce``; ``speedup`` is relative to it),
hpccomm's ``none``+``mpi`` (the same MPI call through hpccomm, which shows the
library's per-call overhead) and each requested (codec, algorithm) case,
size by size, the cases of a size in that order (``--order``).  Output
follows the OSU micro-benchmarks' shape: ``#`` header lines, then one row per
(size, case), then one line per codec: the sizes
where it was faster than ``MPI_Allreduce`` of the same run, and by how much.
An ``auto`` row names the algorithm ``auto`` chose (``auto:twoshot``,
``auto:dense``).  Codecs and algorithms are crossed; a pair whose algorithm
cannot carry the codec (``onebit`` with ``mpi``) is left out, and said only when
a codec or an algorithm is left with no pair at all.

Timing: each iteration is ``Barrier; t0; reduce; t1`` on every rank; the time
of an iteration is the slowest rank's (MAX over ranks), and the table reports
the median, min and max of those over the timed iterations.  By default
(``--order blocks``) each case runs its warm-up and timed iterations before
the next case starts; ``--order interleaved`` warms every case up first and
then times one iteration of each case in turn, so that a slow spell of a
shared machine (seconds long on a cloud VM) falls on every case alike and
the speedups stay put.  Each row's ``span`` says when its timed iterations
ran (seconds from the sweep's start, rank 0's clock; with ``--check`` the
checks between iterations too); the JSON's ``clock_start`` is that start on
rank 0's ``time.perf_counter`` (Linux: ``CLOCK_MONOTONIC``, the clock every
process of rank 0's node shares), so that samples taken there outside the
run (CPU accounting, counters) can be put against each case.  Bandwidths follow
nccl-tests: ``algbw = size / time``, ``busbw = algbw * 2 (P-1)/P``.  For
compressed cases ``algbw`` counts the uncompressed size (the *effective*
bandwidth a user sees); ``wire`` is the bytes this rank sent per call
(the MAX over ranks), ``ratio`` the uncompressed size over ``wire``.

Errors are relative to the exact sum (float64): ``rel_err = ||r - s|| / ||s||``
and ``max_err = max|r - s| / max|s|``, measured on a separate call with fresh
state after the timed loop.  The JSON keeps a hash of the last timed
iteration's result (``result_hash``) and of that fresh call's (``fresh_hash``):
two runs with the same arguments and seed give bit-identical results exactly
when these hashes agree.

``--check`` validates every timed iteration (finite, the same bits on every
rank, within the codec's sanity tolerance of the exact sum), and then the
fresh reducer against :mod:`hpccomm.reference` (:func:`check_reference`):
every rank's input is gathered, and its first two calls must equal the
single-process reference of the same pipeline -- bit for bit where sums run
in a fixed order, within float reassociation where MPI sums floats (with
error feedback the second call carries the first's residuals) -- and the
first call's ``gain`` (``<r, s> / <s, s>``) and ``rel_err`` must lie in the
band the codec's theory gives for N(0, 1) inputs (:func:`hpccomm.reference.error_band`).
A codec that decodes to zeros agrees with its own reference but has gain 0.

``--calibrate FILE`` measures ``auto``'s profile in this launch before the
sweep (what ``bench calibrate`` measures, for the sweep's codecs, in the mode
``--calibrate-mode`` names), writes it to ``FILE`` and lets ``auto`` decide
by it: the profile then comes from the same placement of ranks and the same
state of the MPI library as the sweep, seconds before it.  (On a shared VM
even that does not hold still: its shared-memory copy changes speed within a
launch, see ``docs/results/auto.md``.)
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import sys
import time

import numpy as np

from ..codecs import own_algorithm
from ..codecs.rotation import split_rotate
from .harness import (BUFFERS, allowed_cpus, case_options, device_sync, empty_like, fmt_bytes,
                      host_staging, make_buffer, mpi_library, mpi_thread_level, node_cores,
                      on_device, parse_options, parse_range, sizes_from, slowest_rank, to_numpy)


def default_iterations(nbytes: int) -> int:
    """OSU-like: many iterations for small messages, few for large ones."""
    if nbytes <= 64 << 10:
        return 200
    if nbytes <= 1 << 20:
        return 50
    if nbytes <= 16 << 20:
        return 10
    return 5


#: ``--order``: how one size's cases share the timed iterations (:func:`timed_rows`)
ORDERS = ("blocks", "interleaved")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hpccomm.bench allreduce",
        description="Compare hpccomm collectives with MPI_Allreduce over a size sweep "
                    "(run under mpiexec/srun).")
    p.add_argument("-m", "--message-size", type=parse_range, default=(4 << 10, 16 << 20),
                   metavar="[MIN:]MAX", help="message sizes in bytes of float32 input "
                   "(units K, M, G = KiB, MiB, GiB; default 4K:16M)")
    p.add_argument("-f", "--factor", type=float, default=4.0,
                   help="multiply the size by this between steps (default 4)")
    p.add_argument("-i", "--iterations", type=int, default=None,
                   help="timed iterations per size (default: 200 below 64 KiB, 50 to 1 MiB, "
                        "10 to 16 MiB, 5 above)")
    p.add_argument("-x", "--warmup", type=int, default=None,
                   help="untimed warm-up iterations per size (default: iterations/10, >= 2)")
    p.add_argument("--codec", default="none",
                   help="comma-separated codecs to compare with MPI_Allreduce (default: none)")
    p.add_argument("--algorithm", default="mpi",
                   help="comma-separated algorithms; every codec runs with every algorithm "
                        "that carries it (default: mpi)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="codec/algorithm option, repeatable: KEY=VALUE applies to every case "
                        "whose codec or algorithm takes it (--option ratio=0.01), "
                        "CODEC.KEY=VALUE or ALGORITHM.KEY=VALUE to that one only")
    p.add_argument("--error-feedback", choices=("auto", "on", "off"), default="auto",
                   help="error feedback for the compressed cases (default: the codec's default)")
    p.add_argument("--cols", type=int, default=1024,
                   help="shape the input as a (n/COLS, COLS) matrix when COLS divides n, as a "
                        "layer's gradient; per-column codecs take their columns from it "
                        "(default 1024; 0: always 1-D)")
    p.add_argument("--buffer", choices=BUFFERS, default="numpy",
                   help="buffer type handed to the collectives (default numpy; cupy needs a GPU; "
                        "sim: host memory as a CUDA array, for NUMBA_ENABLE_CUDASIM=1: the "
                        "device path without a GPU, at the simulator's speed)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where --buffer torch lives (cupy is always on the GPU); device buffers "
                        "run the codecs on the GPU where hpccomm has a device path")
    p.add_argument("--threads", type=int, default=1,
                   help="numba threads per rank (default 1: ranks already share the cores)")
    p.add_argument("--seed", type=int, default=0, help="seed for inputs and stochastic codecs")
    p.add_argument("-J", "--json", default=None, metavar="FILE", help="write results as JSON")
    p.add_argument("--csv", default=None, metavar="FILE", help="write results as CSV")
    p.add_argument("--check", action="store_true",
                   help="validate every timed iteration (finite, identical on all ranks, within "
                        "the codec's sanity tolerance of the exact sum; #wrong counts failed "
                        "iterations), then a fresh reducer against the single-process reference "
                        "of its pipeline on the gathered inputs (same bits, or within float "
                        "reassociation where MPI sums floats) and its first result against the "
                        "codec's statistical band (column 'ref'); the exit status is 1 if any "
                        "check failed")
    p.add_argument("--order", choices=ORDERS, default="blocks",
                   help="blocks (default): each case's warm-up and timed iterations, case "
                        "after case; interleaved: every case warmed up, then each timed "
                        "iteration runs every case once (rotating which goes first), so that "
                        "a slow spell of a shared machine falls on all cases alike and their "
                        "ratios to MPI_Allreduce hold (all cases' buffers and state are held "
                        "at once)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--calibrate", default=None, metavar="FILE",
                   help="measure auto's profile in this launch first (as 'bench calibrate'), "
                        "write it to FILE, and let auto decide by it")
    p.add_argument("--calibrate-mode", choices=("quick", "default", "full"), default="default",
                   help="the ladder --calibrate measures (as 'bench calibrate --quick/--full')")
    return p


class Progress:
    """A one-line progress bar on rank 0's stderr (only when it is a terminal)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done = total, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        elapsed = time.perf_counter() - self.t0
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{elapsed:6.1f}s {label[:40]:<40}")
        sys.stderr.flush()
        if self.done == self.total:
            sys.stderr.write("\n")


def _errors(res, exact):
    diff = res.reshape(-1).astype(np.float64) - exact
    norm = float(np.linalg.norm(exact))
    rel = float(np.linalg.norm(diff)) / norm if norm > 0 else float(np.linalg.norm(diff))
    peak = float(np.max(np.abs(exact))) if exact.size else 0.0
    max_err = float(np.max(np.abs(diff))) / peak if peak > 0 else 0.0
    return rel, max_err


class Timed:
    """One case at one size, timed one iteration at a time so that cases can
    be run in blocks or interleaved (``--order``): :meth:`warm` makes the
    untimed calls, each :meth:`step` one timed iteration (``Barrier; t0;
    call; t1`` on every rank), and :meth:`row` the result once all are done.
    ``call`` is the timed call, which a subclass sets: a closure of no
    arguments in every case, so that each pays the same one Python call
    around what it times.  ``span`` is when the timed iterations ran on this
    rank: the first one's start and the last one's end
    (``time.perf_counter`` seconds)."""

    call = None

    def __init__(self, comm, x, iters):
        self.comm, self.x, self.out = comm, x, empty_like(x)
        self.times = np.empty(iters)
        self.span = [None, None]
        self.it = 0

    def warm(self, warmup: int) -> None:
        for _ in range(warmup):
            self.call()

    def step(self) -> None:
        call, out = self.call, self.out
        self.comm.Barrier()
        t0 = time.perf_counter()
        call()
        device_sync(out)
        t1 = time.perf_counter()
        self.times[self.it] = t1 - t0
        if self.span[0] is None:
            self.span[0] = t0
        self.span[1] = t1
        self.after(self.it)
        self.it += 1

    def after(self, it: int) -> None:
        """Per-iteration bookkeeping outside the timed region."""


class RawCase(Timed):
    """The baseline: ``comm.Allreduce(x, out, MPI.SUM)`` called directly.
    Device buffers go to MPI as they are where it is CUDA-aware; otherwise
    they are staged through pinned host buffers, as a user of a host-only MPI
    must (flat copies of the whole buffer, whatever its shape)."""

    def __init__(self, comm, x, exact, iters):
        from mpi4py import MPI

        from ..buffers import mpi_cuda_support

        super().__init__(comm, x, iters)
        self.exact = exact
        out = self.out
        if on_device(x) and not mpi_cuda_support():
            host_in, to_host, from_host = host_staging(x)
            host_out = host_staging(x)[0]

            def allreduce():
                to_host(x, host_in)
                comm.Allreduce(host_in, host_out, op=MPI.SUM)
                from_host(host_out, out)
        else:
            def allreduce():
                comm.Allreduce(x, out, op=MPI.SUM)
        self.call = allreduce

    def row(self) -> dict:
        slowest = slowest_rank(self.comm, self.times)
        rel, max_err = _errors(to_numpy(self.out), self.exact)
        p = self.comm.Get_size()
        digest = result_hash(self.out)
        return {
            "codec": "-", "algorithm": "MPI_Allreduce", "codec_name": "-",
            "algorithm_name": "MPI_Allreduce",
            "time_median": float(np.median(slowest)), "time_min": float(np.min(slowest)),
            "time_max": float(np.max(slowest)), "iterations": len(self.times),
            "t_encode": 0.0, "t_comm": float(np.median(slowest)), "t_decode": 0.0,
            "wire_bytes": 2 * (p - 1) * 4 * self.exact.size // p if p > 1 else 0,
            "wire_modelled": True,
            "segments": 1, "nodes": None, "ranks_per_node": None, "staged": None,
            "staged_bytes": 0,
            "rel_err": rel, "max_err": max_err, "error_feedback": False,
            "wrong": None, "check_failures": [], "check_tolerance": None,
            "reference_ok": None, "reference_failures": [], "reference": None, "band": None,
            "gain": None,
            "result_hash": digest, "fresh_hash": digest,
        }


def result_hash(res) -> str:
    """A short hash of a result's bytes: equal hashes across runs mean
    bit-identical results (the JSON's ``result_hash`` / ``fresh_hash``)."""
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(to_numpy(res)).view(np.uint8)).hexdigest()[:16]


def check_result(comm, res: np.ndarray, exact: np.ndarray, tolerance: float) -> list:
    """``--check`` of one result: finite, bit-identical on every rank, and
    within ``tolerance`` relative L2 error of the exact sum.  Collective;
    returns the list of failed conditions (the same on every rank)."""
    import zlib

    res = res.reshape(-1)
    finite = bool(np.isfinite(res).all())
    crc = zlib.crc32(np.ascontiguousarray(res).view(np.uint8))
    crcs = comm.allgather(crc)
    rel, _ = _errors(res, exact) if finite else (float("inf"), None)
    flags = comm.allgather((finite, rel <= tolerance))
    failed = []
    if not all(f for f, _ in flags):
        failed.append("non-finite values")
    if len(set(crcs)) != 1:
        failed.append("ranks disagree")
    if not all(ok for _, ok in flags):
        failed.append(f"relative error above {tolerance:g}")
    return failed


def node_ids(comm) -> list:
    """Every rank's node, as the lowest rank sharing its memory (collective)."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    first = local.allreduce(comm.Get_rank(), op=MPI.MIN)
    local.Free()
    return comm.allgather(first)


def check_reference(comm, reducer, x, exact: np.ndarray, key: str = "accuracy", calls: int = 2):
    """``--check`` of a fresh ``reducer`` (no call made yet on ``key``) on
    ``x``: ``calls`` calls, each the same bits on every rank and equal to
    :class:`hpccomm.reference.Pipeline` run on every rank's gathered input
    (the later calls with the residuals the first left, when the reducer
    keeps plain residuals); the first within the codec's band of the exact
    float64 sum ``exact`` (:func:`hpccomm.reference.error_band`).  Collective.
    Returns ``(failures, info, first_result)``: the failed conditions (the
    same list on every rank), and ``info`` with ``reference`` ("bits",
    "reassociation" or None: no pipeline known), ``band`` (its bounds, or
    None) and ``gain``."""
    import zlib

    from .. import reference as R

    P, rank = comm.Get_size(), comm.Get_rank()
    results = [np.array(to_numpy(reducer(x, key)), dtype=np.float32) for _ in range(calls)]
    failures = []
    crcs = comm.allgather([zlib.crc32(np.ascontiguousarray(r).view(np.uint8)) for r in results])
    for i in range(calls):
        if len({c[i] for c in crcs}) != 1:
            failures.append(f"reference call {i + 1}: ranks disagree")
    alg = reducer.algorithm
    name = R.pipeline_of(alg)
    nodes = None
    if name == "hierarchical":
        nodes = alg.nodes_option if alg.nodes_option is not None else node_ids(comm)
    x_host = np.ascontiguousarray(to_numpy(x), dtype=np.float32)
    xs = comm.gather(x_host.reshape(-1), root=0)
    info = {"reference": None, "band": None, "gain": None}
    if rank == 0:
        shape, n = tuple(x_host.shape), x_host.size
        opts = {"nodes": nodes, "outer": getattr(alg, "outer", "twoshot"),
                "choice": reducer.stats.last.extra.get("auto")}
        if name is not None:
            memory = reducer.memory.name
            pipe = R.Pipeline(reducer.codec, alg, P, shape, seed=reducer.seed,
                              error_feedback=memory == "residual", **opts)
            for i, res in enumerate(results[:calls if memory in ("none", "residual") else 1]):
                ref = pipe(xs)
                info["reference"] = "bits" if ref.exact else "reassociation"
                msg = R.compare(res, ref)
                if msg:
                    failures.append(f"reference call {i + 1}: {msg}")
        band = R.error_band(reducer.codec, alg, P, n, shape, **opts)
        info["gain"] = R.band_statistics(results[0], exact)[0]
        if band is not None:
            info["band"] = {"gain": list(band.gain), "rel_err": list(band.rel), "why": band.why}
            msg = R.check_band(results[0], exact, band)
            if msg:
                failures.append(msg)
    failures, info = comm.bcast((failures, info), root=0)
    return failures, info, results[0]


class CodecCase(Timed):
    """One (codec, algorithm) through an :class:`~hpccomm.Allreducer` called
    with a key and ``out=`` (its statistics reset after the warm-up); with
    ``check``, every timed iteration is validated outside the timed region
    and a fresh reducer against the reference (:func:`check_reference`)."""

    KEY = "bench"

    def __init__(self, comm, codec, algorithm, x, exact, iters, options, ef, seed,
                 check=False):
        import hpccomm

        super().__init__(comm, x, iters)
        self.args = dict(codec=codec, algorithm=algorithm, error_feedback=ef, check="first",
                         seed=seed, **options)
        reducer = self.reducer = hpccomm.Allreducer(comm, **self.args)
        key, out = self.KEY, self.out

        def reduce():
            reducer(x, key, out=out)
        self.call = reduce
        self.exact, self.check = exact, check
        self.phases = np.empty((iters, 3))
        self.sent = np.empty(iters)
        self.wrong, self.failures = 0, set()
        self.tolerance = reducer.codec.check_tolerance(comm.Get_size(), reducer.memory.enabled)

    def warm(self, warmup: int) -> None:
        super().warm(warmup)
        self.reducer.stats.reset()

    def after(self, it: int) -> None:
        last = self.reducer.stats.last
        self.phases[it] = (last.t_encode, last.t_comm, last.t_decode)
        self.sent[it] = last.bytes_sent
        if self.check:
            failed = check_result(self.comm, to_numpy(self.out), self.exact, self.tolerance)
            self.wrong += bool(failed)
            self.failures.update(failed)

    def row(self) -> dict:
        import hpccomm
        from mpi4py import MPI

        comm, reducer, exact = self.comm, self.reducer, self.exact
        slowest = slowest_rank(comm, self.times)
        local = np.array([*np.median(self.phases, axis=0), np.max(self.sent)], dtype=np.float64)
        worst = np.empty_like(local)
        comm.Allreduce(local, worst, op=MPI.MAX)
        # accuracy: a fresh call (no residual), compared with the exact float64 sum
        fresh = hpccomm.Allreducer(comm, **self.args)
        last_hash = result_hash(self.out)
        ref_failures, ref_info = [], {"reference": None, "band": None, "gain": None}
        if self.check:
            ref_failures, ref_info, fresh_out = check_reference(comm, fresh, self.x, exact)
        else:
            fresh_out = fresh(self.x, "accuracy")
        rel, max_err = _errors(to_numpy(fresh_out), exact)
        last = reducer.stats.last
        return {
            "codec": reducer.codec.describe(), "algorithm": reducer.algorithm.describe(),
            "codec_name": reducer.codec.name, "algorithm_name": reducer.algorithm.name,
            "time_median": float(np.median(slowest)), "time_min": float(np.min(slowest)),
            "time_max": float(np.max(slowest)), "iterations": len(self.times),
            "t_encode": float(worst[0]), "t_comm": float(worst[1]), "t_decode": float(worst[2]),
            "wire_bytes": int(worst[3]), "wire_modelled": bool(last.modelled),
            "segments": int(last.extra.get("segments", 1)),
            # hierarchical: the nodes it found, and this rank's node's ranks
            "nodes": last.extra.get("nodes"),
            "ranks_per_node": last.extra.get("ranks_per_node"),
            "staged": last.extra.get("staged"),
            "staged_bytes": int(last.extra.get("staged_d2h", 0)
                                + last.extra.get("staged_h2d", 0)),
            "rel_err": rel, "max_err": max_err, "error_feedback": reducer.memory.enabled,
            "wrong": self.wrong if self.check else None,
            "check_failures": sorted(self.failures),
            "check_tolerance": self.tolerance,
            "reference_ok": not ref_failures if self.check else None,
            "reference_failures": ref_failures, "reference": ref_info["reference"],
            "band": ref_info["band"], "gain": ref_info["gain"],
            "result_hash": last_hash, "fresh_hash": result_hash(fresh_out),
            # auto: what it chose for this size, and the profile it decided by
            "auto_choice": last.extra.get("auto"),
            "auto_profile": getattr(reducer.algorithm, "source", None),
        }


def timed_rows(make_cases, iters: int, warmup: int, order: str, on_step=None):
    """The rows of one size's cases, in the order ``make_cases`` lists them
    (a sequence of functions, each building one :class:`Timed`).
    ``on_step(j)``, when given, is called after each timed iteration of case
    ``j`` (a progress bar's tick).

    ``blocks``: each case is built, warmed up and timed through all its
    iterations before the next is built.  ``interleaved``: every case is built
    and warmed up first, then iteration ``i`` times each case once, in their
    order, starting from case ``i mod C`` (C cases), so that each case in
    turn runs first: a slow spell of the machine then falls on every case
    alike, and their ratios do not move with it (every case's buffers and
    state are held at once).  Yields each case's row, with its ``span``."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, not {order!r}")
    tick = on_step if on_step is not None else (lambda j: None)
    if order == "blocks":
        for j, make in enumerate(make_cases):
            case = make()
            case.warm(warmup)
            for _ in range(iters):
                case.step()
                tick(j)
            yield dict(case.row(), span=case.span)
        return
    cases = [make() for make in make_cases]
    for case in cases:
        case.warm(warmup)
    count = len(cases)
    for i in range(iters):
        for j in range(count):
            cases[(i + j) % count].step()
            tick((i + j) % count)
    for case in cases:
        yield dict(case.row(), span=case.span)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from mpi4py import MPI

    import numba

    import hpccomm

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    numba.set_num_threads(max(1, min(args.threads, numba.config.NUMBA_NUM_THREADS)))
    from hpccomm.kernels import threads as kernel_threads
    kernel_threads.set_threads(numba.get_num_threads())
    options = parse_options(args.option)
    ef = {"auto": None, "on": True, "off": False}[args.error_feedback]
    codecs = [c.strip() for c in args.codec.split(",") if c.strip()]
    algorithms = [a.strip() for a in args.algorithm.split(",") if a.strip()]
    for c in codecs:
        if split_rotate(c)[0] not in hpccomm.available_codecs():   # "qsgd+rotate" too
            raise SystemExit(f"unknown codec {c!r}; available: {', '.join(hpccomm.available_codecs())}")
    for a in algorithms:
        if a not in hpccomm.available_algorithms():
            raise SystemExit(f"unknown algorithm {a!r}; available: "
                             f"{', '.join(hpccomm.available_algorithms())}")
    cases = [("-", "MPI_Allreduce"), ("none", "mpi")]
    refused = {}
    for c in codecs:
        own = own_algorithm(c)    # powersgd: its own algorithm only
        for a in ([own] if own else algorithms):
            if (c, a) in cases:
                continue
            # construction errors of an Allreducer wait for its first (collective) call;
            # here every rank checks the same thing locally and skips alike
            reducer = hpccomm.Allreducer(comm, codec=c, algorithm=a, **case_options(c, a, options))
            exc = reducer.config_error
            if exc is not None:
                refused[c, a] = exc
                continue
            cases.append((c, a))
    skipped = [f"{c}+{a}: {exc}" for (c, a), exc in refused.items()
               if not any(cc == c for cc, _ in cases) or not any(aa == a for _, aa in cases)]
    unused = [k for k in options
              if not any(case_options(c, a, {k: None}) for c, a in cases[1:])]
    if unused:
        raise SystemExit(f"option(s) {', '.join(unused)} taken by none of the cases")
    sizes = sizes_from(*args.message_size, args.factor)
    if args.calibrate:
        packet = hpccomm.codecs.packet_codecs()
        calibrate_here(comm, args.calibrate, args.calibrate_mode,
                       [n for n in dict.fromkeys(split_rotate(c)[0] for c in codecs)
                        if n in packet])

    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    meta = {"tool": f"hpccomm {hpccomm.__version__}", "mpi": mpi_library(),
            "thread_level": mpi_thread_level(),
            "mpi4py": __import__("mpi4py").__version__, "numpy": np.__version__,
            "numba": numba.__version__, "ranks": size, "threads": numba.get_num_threads(),
            "host": platform.node(), "hosts": comm.allgather(platform.node()),
            "cores": node_cores(comm), "bind": os.environ.get("HPCCOMM_BENCH_BIND", "none"),
            "affinity": comm.allgather(sorted(allowed_cpus())),
            "python": platform.python_version(), "date": date,
            "seed": args.seed, "options": options, "buffer": args.buffer, "cols": args.cols, "error_feedback": args.error_feedback,
            "cases": [f"{c}+{a}" for c, a in cases], "calibrated": args.calibrate,
            "order": args.order}
    if rank == 0:
        print("# hpccomm allreduce benchmark (compared with MPI_Allreduce in the same run)")
        print(f"# tool: {meta['tool']}   mpi4py {meta['mpi4py']}   numpy {meta['numpy']}   "
              f"numba {meta['numba']}")
        print(f"# MPI: {meta['mpi']}   thread level: {meta['thread_level']} "
              "(MPI4PY_RC_THREAD_LEVEL)")
        print(f"# ranks: {size}   numba threads/rank: {meta['threads']}   host: {meta['host']}   "
              f"date: {date}")
        print("# datatype: float32, op: sum; time = slowest rank per iteration, median over "
              "iterations; algbw from the uncompressed size")
        print("# order: " + ("each case's iterations in a block, case after case"
                             if args.order == "blocks" else
                             "cases interleaved, each iteration timing every case once"))
        print(f"# input: N(0,1) per rank, shaped (n/{args.cols}, {args.cols}) where {args.cols} "
              "divides n" if args.cols else "# input: N(0,1) per rank, 1-D")
        for s in skipped:
            print(f"# skipped {s}")
        cols = ("size", "count", "codec", "algorithm", "med(us)", "min(us)", "max(us)",
                "algbw(GB/s)", "busbw(GB/s)", "wire(B)", "ratio", "speedup", "rel_err",
                "enc%", "comm%", "dec%") + (("#wrong", "ref") if args.check else ())
        print("#" + "".join(f"{c:>12}" if i == 2 else f"{c:>14}"
                            for i, c in enumerate(cols))[1:])
        sys.stdout.flush()

    rows = []
    comm.Barrier()
    t_start = time.perf_counter()     # the rows' spans count from here (rank 0's clock)
    meta["clock_start"] = comm.bcast(t_start, root=0)
    iterations = {nbytes: args.iterations or default_iterations(nbytes) for nbytes in sizes}
    progress = Progress(len(cases) * sum(iterations.values()), rank == 0 and not args.no_progress)
    for nbytes in sizes:
        n = nbytes // 4
        rng = np.random.default_rng([args.seed, rank, n])
        x_host = rng.standard_normal(n).astype(np.float32)
        exact = np.empty(n, dtype=np.float64)
        comm.Allreduce(x_host.astype(np.float64), exact, op=MPI.SUM)
        if args.cols and n % args.cols == 0 and n > args.cols:
            x_host = x_host.reshape(n // args.cols, args.cols)
        x = make_buffer(x_host, args.buffer, args.device)
        iters = iterations[nbytes]
        warmup = args.warmup if args.warmup is not None else max(2, iters // 10)
        makers = [functools.partial(RawCase, comm, x, exact, iters)
                  if algorithm == "MPI_Allreduce" else
                  functools.partial(CodecCase, comm, codec, algorithm, x, exact, iters,
                                    case_options(codec, algorithm, options), ef, args.seed,
                                    check=args.check)
                  for codec, algorithm in cases]
        baseline = None
        def tick(j, nbytes=nbytes):
            progress.step(f"{fmt_bytes(nbytes)} {'+'.join(cases[j])}")

        for (codec, algorithm), r in zip(cases, timed_rows(makers, iters, warmup, args.order,
                                                           on_step=tick)):
            r["span"] = [t - t_start for t in r["span"]]
            if baseline is None:
                baseline = r["time_median"]
            t = r["time_median"]
            algbw = nbytes / t / 1e9 if t > 0 else float("inf")
            r.update(size=nbytes, count=n, algbw=algbw, busbw=algbw * 2 * (size - 1) / size,
                     speedup=baseline / t if t > 0 else float("inf"),
                     ratio=nbytes / r["wire_bytes"] if r["wire_bytes"] else None)
            rows.append(r)
            if rank == 0:
                tot = max(t, 1e-12)
                ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
                shown = f"auto:{r['auto_choice']}" if r.get("auto_choice") else algorithm
                print(f"{nbytes:>13} {n:>13} {codec:>11} {shown:>13} "
                      f"{t * 1e6:>13.1f} {r['time_min'] * 1e6:>13.1f} {r['time_max'] * 1e6:>13.1f} "
                      f"{algbw:>13.3f} {r['busbw']:>13.3f} {r['wire_bytes']:>13} {ratio:>13} "
                      f"{r['speedup']:>13.2f} {r['rel_err']:>13.2e} "
                      f"{100 * r['t_encode'] / tot:>13.1f} {100 * r['t_comm'] / tot:>13.1f} "
                      f"{100 * r['t_decode'] / tot:>13.1f}"
                      + (f" {r['wrong'] if r['wrong'] is not None else '-':>13}"
                         f" {_ref_cell(r['reference_ok']):>13}" if args.check else ""),
                      flush=True)
    wrong = sum(r["wrong"] or 0 for r in rows)
    off = sum(r["reference_ok"] is False for r in rows)
    if rank == 0:
        for line in summary(rows):
            print(line)
        if args.check:
            bad = [f"{r['size']} {r['codec']}+{r['algorithm']}: {', '.join(r['check_failures'])}"
                   for r in rows if r["wrong"]]
            bad += [f"{r['size']} {r['codec']}+{r['algorithm']}: {failure}"
                    for r in rows for failure in r["reference_failures"]]
            print(f"# check: {'FAILED' if wrong or off else 'OK'}: {wrong} wrong iteration(s), "
                  f"{off} case(s) off the reference or the codec's band"
                  + ("".join(f"\n#   {b}" for b in bad)))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
        if args.csv:
            import csv

            keys = list(dict.fromkeys(k for r in rows for k in r))   # MPI_Allreduce has fewer
            with open(args.csv, "w", newline="", encoding="utf-8") as f:
                w = csv.DictWriter(f, fieldnames=keys)
                w.writeheader()
                w.writerows(rows)
    return 1 if wrong or off else 0


def calibrate_here(comm, path: str, mode: str, codecs) -> None:
    """``--calibrate``: measure the profile of ``codecs`` on a duplicate of
    ``comm``, write it to ``path`` and point ``auto`` at it (every rank;
    reducers made from here on read it)."""
    from .calibrate import calibrate, write

    path = os.path.abspath(path)
    calib = comm.Dup()
    t0 = time.perf_counter()
    profile = calibrate(calib, mode, codecs)
    write(calib, profile, path, time.perf_counter() - t0)
    calib.Free()
    os.environ["HPCCOMM_PROFILE"] = path


#: a codec "pays" at a size where its fastest algorithm beats MPI_Allreduce
#: of the same run by more than this (the harness's run-to-run noise)
PAYS = 1.05


def summary(rows) -> list:
    """One line per codec: the sizes where its fastest compressed case beat
    ``MPI_Allreduce`` of the same run by more than :data:`PAYS`, and by how
    much; or, where it never did, its best ratio.  An ``auto`` call that sent
    dense values is not compression: it is counted apart."""
    raw = {r["size"]: r["time_median"] for r in rows if r["algorithm"] == "MPI_Allreduce"}
    best, dense = {}, {}
    for r in rows:
        if r["algorithm"] == "MPI_Allreduce" or r["codec_name"] == "none":
            continue
        codec = r["codec_name"]
        per_size = best.setdefault(codec, {})
        if r.get("auto_choice") == "dense":
            dense.setdefault(codec, set()).add(r["size"])
            continue
        t = r["time_median"]
        speed = raw[r["size"]] / t if t > 0 else float("inf")
        label = f"auto:{r['auto_choice']}" if r.get("auto_choice") else r["algorithm_name"]
        if r["size"] not in per_size or speed > per_size[r["size"]][0]:
            per_size[r["size"]] = (speed, label)
    if not best:
        return []
    profiles = sorted({r["auto_profile"] for r in rows if r.get("auto_profile")})
    lines = ["# auto decided by: " + ", ".join(
        "the built-in defaults (no profile for these hosts and ranks: mpiexec -n P python -m "
        "hpccomm.bench calibrate)" if p == "defaults" else p for p in profiles)] if profiles else []
    lines.append(f"# where compression paid: each codec's fastest compressed case against "
                 f"MPI_Allreduce of the same run (> {PAYS:.2f}x)")
    for codec, per_size in best.items():
        sizes = sorted(dense.get(codec, ()))
        note = (f"; auto sent dense at {fmt_bytes(sizes[0])}-{fmt_bytes(sizes[-1])}"
                f" ({len(sizes)} sizes)" if len(sizes) > 1 else
                f"; auto sent dense at {fmt_bytes(sizes[0])}" if sizes else "")
        if not per_size:
            lines.append(f"#   {codec:<10} not compressed at any size{note}")
            continue
        paid = [size for size, (speed, _) in sorted(per_size.items()) if speed > PAYS]
        top_size, (top, how) = max(per_size.items(), key=lambda kv: kv[1][0])
        if paid:
            lines.append(f"#   {codec:<10} paid at {', '.join(fmt_bytes(p) for p in paid)}: "
                         f"up to {top:.2f}x ({how}, {fmt_bytes(top_size)}){note}")
        else:
            lines.append(f"#   {codec:<10} did not pay here: at best {top:.2f}x MPI_Allreduce "
                         f"({how}, {fmt_bytes(top_size)}){note}")
    return lines


def _ref_cell(ok) -> str:
    return "-" if ok is None else "ok" if ok else "FAILED"


if __name__ == "__main__":
    sys.exit(main())
