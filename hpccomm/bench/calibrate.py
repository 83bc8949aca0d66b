"""``python -m hpccomm.bench calibrate``: measure this machine and communicator
for ``algorithm="auto"`` and write the profile it reads.

    mpiexec -n P python -m hpccomm.bench calibrate [--quick | --full] [-o FILE]

Measures (median over repetitions, slowest rank):

* the MPI patterns hpccomm uses -- ``MPI_Allreduce``, ``MPI_Alltoallv`` and
  ``MPI_Allgatherv`` -- at a ladder of message sizes on this communicator;
* every codec's kernels at a few sizes (in and beyond the caches): the
  worker's encode (with error feedback where the codec fuses it), the owner
  step with two packets, one decode -- every rank running them at once, as in
  a collective, so that ranks sharing cores or memory bandwidth share them
  here too;
* the Python of one call per algorithm (``none`` on 256 elements through the
  reducer, less what the patterns and kernels predict), and per codec and
  compressed algorithm (calls on 1024 to 65536 elements, likewise);
* how long a collective waits after a compute phase of a given length
  (``waits``: a numpy pass then an 8-byte ``MPI_Allreduce``, less both apart);
* how much of the transfers ``twoshot``'s pipeline hides under its kernels
  (``overlap``: eight segments of a compute phase and a nonblocking
  ``MPI_Alltoallv`` of 128 KiB per peer as long, against both apart);
* the ranks per core of the busiest node (``oversubscription``, for the record).

The profile (schema in :mod:`hpccomm.cost_model`) goes to ``-o FILE``, else to
``$HPCCOMM_PROFILE``, else to ``~/.cache/hpccomm/profile-<host set>-P<P>.json``,
where ``auto`` looks for it.  About half a minute by default (``--quick``: seconds).
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time

import numpy as np

from .harness import slowest_median

LADDERS = {
    "quick": [8, 1 << 16, 1 << 22],
    "default": [8, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26],
    "full": [8, 1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24,
             1 << 26, 1 << 28],
}
#: kernel sizes: small (the fixed cost), in cache, and far beyond the caches --
#: every factor of 4, since some kernels change method with the size (topk's
#: exact selection of short vectors)
KERNEL_SIZES = {"quick": (4096, 1 << 20),
                "default": (1 << 9, 1 << 11, 1 << 13, 1 << 15, 1 << 17, 1 << 19, 1 << 21,
                            1 << 23),
                "full": (1 << 8, 1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22,
                         1 << 24)}
REPS = {"quick": 3, "default": 5, "full": 9}
#: at least this many repetitions where one takes microseconds (at most 1 MiB
#: or 2^18 elements): their medians move by tens of percent at 5
SMALL_REPS = 50


def _reps(size: int, reps: int, small: int) -> int:
    return max(reps, SMALL_REPS) if size <= small else reps


def _blocks(buf, block: int, P: int):
    """``buf`` as ``P`` blocks of ``block`` bytes, for a vector collective."""
    from mpi4py import MPI

    return [buf, ([block] * P, [block * j for j in range(P)]), MPI.BYTE]


def measure_patterns(comm, sizes, reps):
    """``{pattern: [[bytes, seconds], ...]}`` on ``comm``."""
    from mpi4py import MPI

    P = comm.Get_size()
    out = {"allreduce": [], "alltoallv": [], "allgatherv": []}
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        x = np.ones(n, np.float32)
        y = np.empty_like(x)
        r = _reps(nbytes, reps, 1 << 20)
        out["allreduce"].append([nbytes, slowest_median(
            comm, lambda: comm.Allreduce(x, y, op=MPI.SUM), r)])
        block = max(1, nbytes)
        sb = np.ones(block * P, np.uint8)
        rb = np.empty_like(sb)
        out["alltoallv"].append([nbytes, slowest_median(
            comm, lambda: comm.Alltoallv(_blocks(sb, block, P), _blocks(rb, block, P)), r)])
        out["allgatherv"].append([nbytes, slowest_median(
            comm, lambda: comm.Allgatherv(sb[:block], _blocks(rb, block, P)), r)])
    return out


#: inputs the kernels cycle through, and the steps taken before timing: the
#: residual of error feedback grows over the first steps of training, and a
#: kernel's cost can depend on it (topk's encode of 32K elements took 91 us with
#: a fresh residual and 257 us with a carried one while its selection was
#: numba's partition; docs/data/i33/kth/)
INPUTS, STEADY_STEPS = 4, 20


class _Feedback:
    """``step(x)``: one call of ``fn(x, e, e_out)`` that then takes ``e_out``
    as the residual -- error feedback's loop, as a collective runs it."""

    def __init__(self, n, fn):
        self.e, self.e_out, self.fn = np.zeros(n, np.float32), np.empty(n, np.float32), fn

    def step(self, x):
        result = self.fn(x, self.e, self.e_out)
        self.e, self.e_out = self.e_out, self.e
        return result


def measure_kernels(comm, codec, n, reps):
    """``{step: seconds}`` of ``codec`` on ``n`` float32 elements: every rank of
    ``comm`` runs each step at once, the slowest rank's median (collective).
    A biased codec is measured as error feedback runs it, with the worker's and
    the owner's residuals carried from step to step over changing inputs, after
    :data:`STEADY_STEPS` steps."""
    reps = _reps(n, reps, 1 << 18)
    from hpccomm.codecs.base import EncodeContext

    rng = np.random.default_rng(n)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(INPUTS)]
    ctx = EncodeContext(shape=(n,))
    turn = itertools.count()
    feedback = codec.biased and getattr(codec, "encode_with_feedback", None) is not None
    if feedback:
        worker = _Feedback(n, lambda x, e, e_out: codec.encode_with_feedback(x, e, e_out, ctx))
        for i in range(STEADY_STEPS):
            worker.step(xs[i % INPUTS])
        enc = lambda: worker.step(xs[next(turn) % INPUTS])  # noqa: E731
    else:
        enc = lambda: codec.encode(xs[next(turn) % INPUTS], ctx)  # noqa: E731
    received = [enc(), enc()]            # two ranks' packets of different inputs
    packet = received[0]
    out = np.empty(n, np.float32)
    if getattr(codec, "owner_step", None) is not None:
        if feedback:
            owner = _Feedback(n, lambda _, e, e_out: codec.owner_step(received, e, e_out, out,
                                                                       ctx))
            for _ in range(STEADY_STEPS):
                owner.step(None)
            own = lambda: owner.step(None)  # noqa: E731
        else:
            own = lambda: codec.owner_step(received, None, None, out, ctx)  # noqa: E731
    else:
        def own():
            out[:] = 0
            for p in received:
                codec.decode_add(p, out)
            codec.decode(codec.reencode(out.copy(), ctx), out)
    return {"encode": slowest_median(comm, enc, reps), "owner": slowest_median(comm, own, reps),
            "decode": slowest_median(comm, lambda: codec.decode(packet, out), reps)}


#: elements of the calls that measure a codec's per-call cost (4-256 KiB): the
#: sizes where a repeated call's plan may run kernels without the codec calls
#: that the kernel ladder times, so that the term depends on the size
CALL_SIZES = (1024, 4096, 16384, 65536)


def measure_call(comm, codec, algorithm, n, reps):
    """Seconds outside MPI of a repeated call of one key on ``n`` elements
    through the reducer (``check="first"``: the steady state of a training
    loop's key): each call's time less what its statistics count inside MPI
    (``t_comm``), the slowest rank's per call, their median.  None where
    ``algorithm`` cannot carry ``codec`` (collective).

    The time inside MPI is left out: it is the patterns' and the waits'
    term, and a call's residual over their prediction would carry into the
    per-call term whatever the MPI did at that moment (at P = 3 and 4 on
    two cores, ``allgather``'s term read +60 to +2780 µs where the calls spent
    11-145 µs outside MPI)."""
    import hpccomm

    x = np.random.default_rng(comm.Get_rank()).standard_normal(n).astype(np.float32)
    out = np.empty_like(x)
    r = hpccomm.Allreducer(comm, codec=codec, algorithm=algorithm, check="first")
    if r.config_error is not None:      # the same on every rank (its call would raise it)
        return None
    for _ in range(20):
        r(x, key="calibrate", out=out)
    return slowest_median(comm, lambda: r(x, key="calibrate", out=out), max(reps, SMALL_REPS),
                          excluded=lambda: r.stats.t_comm)


#: elements of the compute phases that :func:`measure_waits` times
WAIT_SIZES = {"quick": (1 << 12, 1 << 16, 1 << 20),
              "default": (1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22,
                          1 << 24, 1 << 26)}
WAIT_SIZES["full"] = WAIT_SIZES["default"]


def measure_waits(comm, reps, sizes):
    """``[[compute seconds, wait seconds], ...]``: each rank makes a pass over
    ``n`` float32 values, then the 8-byte ``MPI_Allreduce`` of a collective's
    start; the wait is the pair's time less the pass and the allreduce each
    timed alone (all slowest-rank medians; collective)."""
    from mpi4py import MPI

    a, b = np.zeros(1, np.float64), np.zeros(1, np.float64)
    sync = lambda: comm.Allreduce(a, b, op=MPI.SUM)  # noqa: E731
    alone = slowest_median(comm, sync, max(reps, SMALL_REPS))
    out = [[0.0, 0.0]]
    for n in sizes:
        x = np.ones(n, np.float32)
        y = np.empty_like(x)
        r = max(reps, 15)      # the wait is a difference of two noisy medians
        work = lambda: np.multiply(x, np.float32(1.0001), out=y)  # noqa: E731
        compute = slowest_median(comm, work, r)
        both = slowest_median(comm, lambda: (work(), sync()), r)
        out.append([compute, max(both - compute - alone, 0.0)])
    return out


def measure_overlap(comm, reps, block=1 << 17, segments=8):
    """The share of the shorter of transfers and kernels that ``twoshot``'s
    pipeline hides: ``segments`` times a compute phase (passes over 2^20
    float32 values, about as long as one transfer), then the start of that
    segment's ``MPI_Ialltoallv`` of ``block`` bytes per peer, then the wait
    for the previous segment's -- against the phases timed apart
    (slowest-rank medians; collective)."""
    from mpi4py import MPI

    P = comm.Get_size()
    send = _blocks(np.ones(block * P, np.uint8), block, P)
    recvs = [_blocks(np.empty(block * P, np.uint8), block, P) for _ in range(2)]
    r = max(reps, 15)
    wire = slowest_median(comm, lambda: comm.Alltoallv(send, recvs[0]), r)
    x = np.ones(1 << 20, np.float32)
    y = np.empty_like(x)
    one = slowest_median(comm, lambda: np.multiply(x, np.float32(1.0001), out=y), r)
    passes = comm.allreduce(max(1, round(wire / max(one, 1e-9))), op=MPI.MAX)

    def work():
        for _ in range(passes):
            np.multiply(x, np.float32(1.0001), out=y)

    def pipeline():
        pending = None
        for s in range(segments):
            work()
            req = comm.Ialltoallv(send, recvs[s % 2])
            if pending is not None:
                pending.Wait()
            pending = req
        pending.Wait()

    compute = slowest_median(comm, work, r)
    together = slowest_median(comm, pipeline, max(reps, 5))
    hidden = segments * (wire + compute) - together
    most = segments * min(wire, compute) * (1 - 1 / segments)
    return min(max(hidden / most, 0.0), 1.0)


def measure_overhead(comm, reps):
    """Seconds outside MPI of one call on 256 elements per algorithm, through
    the reducer (``dense``: ``none`` + ``mpi``; :func:`measure_call`)."""
    return {name: measure_call(comm, "none", algorithm, 256, reps) for name, algorithm in
            (("dense", "mpi"), ("twoshot", "twoshot"), ("allgather", "allgather"))}


def build_parser():
    p = argparse.ArgumentParser(prog="python -m hpccomm.bench calibrate",
                                description="Measure the MPI patterns and codec kernels of "
                                            "this machine for algorithm='auto'.")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="3 sizes up to 4 MiB, 3 repetitions")
    g.add_argument("--full", action="store_true", help="11 sizes up to 256 MiB, 9 repetitions")
    p.add_argument("-o", "--output", default=None, help="profile file (default: see above)")
    p.add_argument("--codec", default=None, help="comma-separated codecs (default: all)")
    p.add_argument("--if-missing", action="store_true",
                   help="measure only when no valid profile exists at the path (./dev.sh bench "
                        "uses this before its sweep)")
    return p


def calibrate(comm, mode: str = "default", codecs=None) -> dict:
    """Measure the profile of ``comm`` (collective; every rank returns it):
    the ladder, repetitions and kernel sizes of ``mode`` (a key of
    :data:`LADDERS`), the kernels of ``codecs`` (default: every packet codec)."""
    from mpi4py import MPI

    import hpccomm
    from hpccomm import cost_model
    from hpccomm.collectives.auto import host_set_name
    from hpccomm.communicators import ranks_on_node

    from .harness import node_cores

    P = comm.Get_size()
    patterns = measure_patterns(comm, LADDERS[mode], REPS[mode])
    waits = measure_waits(comm, REPS[mode], WAIT_SIZES[mode]) if P > 1 else [[0.0, 0.0]]
    overlap = measure_overlap(comm, REPS[mode]) if P > 1 else 1.0
    names = (list(codecs) if codecs else
             [c for c in hpccomm.codecs.packet_codecs() if not c.startswith("test-")])
    names = names + ["none"] if "none" not in names else names   # for the overhead
    kernels = {}
    for name in names:
        codec = hpccomm.get_codec(name)
        steps = {k: [] for k in cost_model.KERNELS}
        for n in KERNEL_SIZES[mode]:
            t = measure_kernels(comm, codec, n, REPS[mode])
            for k in cost_model.KERNELS:
                steps[k].append([n, t[k]])
        kernels[name] = steps
    kernels.setdefault("*", kernels.get("onebit", cost_model.DEFAULT["kernels"]["*"]))
    per_call = measure_overhead(comm, REPS[mode])
    local = ranks_on_node(comm)
    over = comm.allreduce(max(1.0, local / node_cores(comm)), op=MPI.MAX)
    probe = cost_model.CostModel({**cost_model.DEFAULT, "patterns": patterns,
                                  "kernels": kernels, "waits": waits, "overlap": overlap,
                                  "overhead": {a: 0.0 for a in cost_model.ALGORITHMS}})
    none = hpccomm.get_codec("none")
    overhead = {a: max(per_call[a] - cost_model.predict_terms(probe, none, a, 256, P,
                                                              (256,))["kernels"], 0.0)
                if P > 1 else per_call[a] for a in cost_model.ALGORITHMS[1:]}
    overhead = {"dense": per_call["dense"], **overhead}
    calls = {}
    for name in (names if P > 1 else []):
        codec = hpccomm.get_codec(name)
        for alg in cost_model.ALGORITHMS[1:]:
            ladder = []
            for n in CALL_SIZES:
                t = measure_call(comm, name, alg, n, REPS[mode])
                if t is None:
                    break
                # signed: a planned call skips the codec calls' Python the kernels hold
                ladder.append([n, t - cost_model.predict_terms(probe, codec, alg, n, P,
                                                               (n,))["kernels"]])
            if ladder:
                calls.setdefault(name, {})[alg] = ladder
    return {"format": cost_model.FORMAT,
            "machine": {"hosts": host_set_name(comm), "ranks": P,
                        "mpi": MPI.Get_library_version().split("\n")[0].strip()},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mode": mode,
            "patterns": patterns, "kernels": kernels, "overhead": overhead,
            "calls": calls, "waits": waits, "overlap": overlap,
            "oversubscription": over}


def write(comm, profile: dict, path: str, seconds: float) -> None:
    """Save ``profile`` to ``path`` (rank 0) and print what it holds.
    Collective: every rank returns once the file is there, or exits with
    the same message where rank 0 could not write it."""
    from hpccomm import cost_model

    err = None
    if comm.Get_rank() == 0:
        try:
            cost_model.save(profile, path)
        except (OSError, cost_model.ProfileError) as exc:
            err = f"hpccomm calibrate: could not write the profile {path}: {exc}"
    err = comm.bcast(err)
    if err is not None:
        raise SystemExit(err)
    if comm.Get_rank() == 0:
        print(f"# hpccomm calibrate ({profile['mode']}, P = {comm.Get_size()}, {seconds:.1f} s): "
              f"wrote {path}")
        for name, pts in profile["patterns"].items():
            print(f"#   {name:<10} " + "  ".join(f"{b} B: {t * 1e6:.1f} us" for b, t in pts))
        print("#   waits after      " + "  ".join(f"{c * 1e6:.0f} us: {w * 1e6:.1f} us"
                                                   for c, w in profile["waits"][1:]))
        print(f"#   overlap of transfers and kernels: {profile['overlap']:.2f}")
        print("#   overhead per call: " + "  ".join(f"{a} {t * 1e6:.1f} us"
                                                   for a, t in profile["overhead"].items()),
              flush=True)
    comm.Barrier()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from mpi4py import MPI

    from hpccomm import cost_model
    from hpccomm.collectives.auto import host_set_name, profile_location

    mode = "quick" if args.quick else "full" if args.full else "default"
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    path = args.output or profile_location(comm, host_set_name(comm))
    if args.if_missing:
        usable = rank == 0 and cost_model.load(path)[1] == path
        if comm.bcast(usable):
            if rank == 0:
                print(f"# hpccomm calibrate: the profile {path} exists (delete it to measure "
                      "again)")
            return 0
    t0 = time.perf_counter()
    profile = calibrate(comm, mode, args.codec.split(",") if args.codec else None)
    write(comm, profile, path, time.perf_counter() - t0)
    comm.Free()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
