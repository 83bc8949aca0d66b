"""Faults injected into a real MPI job, one rank at a time, and the program
the fault tests launch (``tests/test_faults.py``)::

    mpiexec -n P python tests/faults.py error ALGORITHM WHERE KIND [--device] [--raise] [--step S]
                                                                   [--started]
    mpiexec -n 3 python tests/faults.py kill started|thread
    mpiexec -n 3 python tests/faults.py stall SECONDS
    mpiexec -n 3 python tests/faults.py finalize atexit|explicit

``error``: three calls of one key (with the codec :data:`CASES` names for
the algorithm); on the third, rank 1 is hit at one of its
transfers: ``KIND`` is ``corrupt`` -- eight bytes of the header of a packet received
from another rank are flipped, so that the decoder itself refuses it -- or
``raise``, a ``RuntimeError`` raised right after a transfer (a codec, a
plug-in or a kernel failing on one rank).  ``WHERE`` is ``first`` or
``last``: the call's first or last transfer (for ``corrupt``: that brings
packets), counted on the first two calls -- twoshot's all-to-all, whose
packets the owner decodes, and its allgather, which the final decode reads.  Every rank catches what its call
raises and goes on to a closing barrier, as a training code that logs an
error and carries on would: without a fail-stop, the other ranks wait in the
call forever.  ``--device``: the input is a device array of the host-memory
backend with device kernels (under ``NUMBA_ENABLE_CUDASIM=1``: the device
twin's kernels run in numba's simulator).  ``--raise``: ``on_error="raise"``.
``--step S``: hit call ``S + 1`` instead (``first`` only for ``S = 0``):
kylix routes on its first call, exchanging indices.  ``--started``: every
call is ``start(...).wait()`` (the error is met on the progress thread).

``kill``, ``stall``, ``finalize``: see :func:`kill_job`, :func:`stall_job`,
:func:`finalize_job`.

The injector patches :class:`hpccomm.collectives.transport.Transport` (and
the transfers that go around it: a repeated call's
:class:`~hpccomm.collectives.transport.FixedExchange`, the lean path's
``allreduce_sum``) in this process only: the library is the one under test.
"""
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

#: Transport methods whose result is data received from other ranks
BLOCKING = ("alltoallv", "allgatherv", "sendrecv", "recv", "allreduce", "reduce_bcast",
            "bcast_object", "alltoallv_device", "allgatherv_device")
NONBLOCKING = ("ialltoallv", "iallgatherv", "irecv", "iallreduce")


class Injector:
    """Counts this process's transfers (:meth:`reset` before a call) -- those
    that bring packets from other ranks, for ``corrupt`` -- and hits the
    ``at``-th one (1-based) once :meth:`arm` is called."""

    def __init__(self):
        self.count = 0
        self.packets = 0
        self.at = None
        self.kind = None
        self.hit = None

    def reset(self):
        self.count = self.packets = 0

    def arm(self, at: int, kind: str):
        self.at, self.kind = at, kind

    def install(self):
        from hpccomm.collectives import transport as T

        for name in BLOCKING:
            original = getattr(T.Transport, name)
            setattr(T.Transport, name, self._blocking(original, name))
        for name in NONBLOCKING:
            original = getattr(T.Transport, name)
            setattr(T.Transport, name, self._nonblocking(original, name))
        for name in ("alltoallv", "allgatherv"):   # a repeated twoshot call's plan
            original = getattr(T.FixedExchange, name)
            setattr(T.FixedExchange, name, self._blocking(original, name))
        import hpccomm.core    # the repeated dense call of a key goes around the Transport

        dense = hpccomm.core.allreduce_sum
        hpccomm.core.allreduce_sum = lambda comm, *args: self._received(
            "allreduce_sum", dense(comm, *args), comm.Get_rank())

    def _blocking(self, original, name):
        def wrapper(net, *args, **kwargs):
            return self._received(name, original(net, *args, **kwargs), net.rank)
        return wrapper

    def _nonblocking(self, original, name):
        def wrapper(net, *args, **kwargs):
            request = original(net, *args, **kwargs)
            finish = request._finish
            request._finish = lambda: self._received(name, finish(), net.rank)
            return request
        return wrapper

    def _received(self, name, result, rank):
        self.count += 1
        packet = self._foreign_packet(result, rank)
        self.packets += packet is not None
        at = self.packets if self.kind == "corrupt" else self.count
        if self.at is None or at != self.at or (self.kind == "corrupt" and packet is None):
            return result
        self.at = None
        self.hit = name
        if self.kind == "raise":
            raise RuntimeError(f"injected fault after {name}")
        head = packet[:8]
        head ^= np.uint8(0x5A)
        return result

    @staticmethod
    def _foreign_packet(result, rank):
        """The first non-empty packet in ``result`` that came from another
        rank (a list by source, or one payload), or None."""
        if isinstance(result, list):
            for j, p in enumerate(result):
                if j != rank and isinstance(p, np.ndarray) and p.dtype == np.uint8 and p.size:
                    return p
            return None
        if isinstance(result, np.ndarray) and result.dtype == np.uint8 and result.size:
            return result
        return None


INJECTOR = Injector()

#: the codec each algorithm is tried with, and its options
CASES = {
    "twoshot": ("onebit", {}),
    "allgather": ("topk", {"ratio": 0.05}),
    "hierarchical": ("onebit", {}),
    "auto": ("onebit", {}),
    "mpi": ("none", {}),
    "summable": ("terngrad", {}),
    "powersgd": ("powersgd", {}),
    "kylix": ("topk", {"ratio": 0.05}),
    "oktopk": ("topk", {"ratio": 0.05}),
    "rle_pipeline": ("topk", {"ratio": 0.05}),
    "sparse_allgather": ("topk", {"ratio": 0.05}),
    "sparse_op": ("topk", {"ratio": 0.05}),
    "sparse_rd": ("topk", {"ratio": 0.05}),
    "sparse_split": ("topk", {"ratio": 0.05}),
}


def error_job(algorithm, where, kind, device, on_error="abort", step_hit=2, started=False):
    from mpi4py import MPI

    import hpccomm

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    codec, options = CASES[algorithm]
    if algorithm == "hierarchical":     # two emulated nodes: compressed traffic between them
        options = {"nodes": [2 * r // comm.Get_size() for r in range(comm.Get_size())]}
    shape = (64, 320) if algorithm == "powersgd" else (2048 if device else 20480,)
    if on_error != "abort":     # (the default is not named: older versions run this too)
        options = dict(options, on_error=on_error)
    reducer = hpccomm.Allreducer(comm, codec=codec, algorithm=algorithm, **options)
    rng = np.random.default_rng(rank)
    if device:
        from hpccomm.buffers.host_device import HostDeviceBackend

        backend = HostDeviceBackend(device_kernels=True)
        hpccomm.register_device_backend(backend)
        from hpccomm.buffers.host_device import HostDeviceArray as wrap
    else:
        def wrap(a):
            return a
    INJECTOR.install()
    counts, packets = [], []
    for step in range(3):
        x = wrap(rng.standard_normal(shape).astype(np.float32))
        INJECTOR.reset()
        if step == step_hit and rank == 1:
            # the transfers of the kind hit (corrupt: those that bring packets) the call
            # before made: the last of them is where "last" hits (none before call 1)
            last = (packets if kind == "corrupt" else counts)[-1] if counts else None
            if last is not None:
                print(f"rank 1: call {step} made {last} transfers of the kind hit", flush=True)
            INJECTOR.arm(1 if where == "first" else last, kind)
        try:
            if started:
                reducer.start(x, key="w").wait()
            else:
                reducer(x, key="w")
            outcome = "returned"
        except Exception as exc:  # noqa: BLE001 -- reported, then the program goes on
            outcome = f"raised {type(exc).__name__}: {exc}"
        counts.append(INJECTOR.count)
        packets.append(INJECTOR.packets)
        if step == step_hit:
            print(f"rank {rank}: call {step + 1} {outcome} (transfers {counts}, hit {INJECTOR.hit})",
                  flush=True)
    comm.Barrier()
    print(f"rank {rank}: finished", flush=True)


def _data(rank, step, n=1 << 16):
    return np.random.default_rng(1000 * rank + step).standard_normal(n).astype(np.float32)


def kill_job(when):
    """Rank 1 is SIGKILLed with a started call: ``started`` right after
    ``start()`` returned, the other ranks already waiting; ``thread`` while
    its progress thread sits inside the call's first collective (the others
    join 2 s late; the kill comes at 1 s)."""
    import os as _os

    from mpi4py import MPI

    import hpccomm

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    reducer = hpccomm.Allreducer(comm, codec="onebit", algorithm="twoshot")
    reducer(_data(rank, 0), key="w")          # the private communicator exists
    if when == "thread" and rank != 1:
        time.sleep(2)
    request = reducer.start(_data(rank, 1), key="w")
    if rank == 1:
        if when == "thread":
            time.sleep(1)
        print("rank 1: killing itself", flush=True)
        _os.kill(_os.getpid(), signal.SIGKILL)
    request.wait()
    comm.Barrier()
    print(f"rank {rank}: finished", flush=True)


def stall_job(seconds):
    """Rank 1 stalls ``seconds`` before it starts its second call, while the
    other ranks' progress threads wait inside it; every result must equal
    the same calls' without a stall, bit for bit, on every rank."""
    import hashlib

    from mpi4py import MPI

    import hpccomm

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()

    def run(stall):
        reducer = hpccomm.Allreducer(comm, codec="onebit", algorithm="twoshot")
        h = hashlib.sha256()
        for step in range(3):
            if stall and rank == 1 and step == 1:
                time.sleep(seconds)
            h.update(reducer.start(_data(rank, step), key="w").wait().tobytes())
            h.update(reducer(_data(rank, step + 10), key="b").tobytes())
        return h.hexdigest()

    t0 = time.monotonic()
    stalled = run(True)
    waited = time.monotonic() - t0
    plain = run(False)
    digests = comm.allgather(stalled)
    same = stalled == plain and len(set(digests)) == 1
    print(f"rank {rank}: stalled run took {waited:.1f} s, results "
          f"{'the same as without the stall, on every rank' if same else 'DIFFER'}", flush=True)
    comm.Barrier()
    print(f"rank {rank}: finished", flush=True)


def finalize_job(how):
    """Every rank starts four calls and never waits for them; then the
    program ends (``atexit``: the interpreter's exit finalizes MPI) or calls
    ``MPI.Finalize()`` itself (``explicit``)."""
    from mpi4py import MPI

    import hpccomm

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    reducer = hpccomm.Allreducer(comm, codec="onebit", algorithm="twoshot")
    requests = [reducer.start(_data(rank, i, 1 << 18), key=f"k{i}") for i in range(4)]
    print(f"rank {rank}: leaving with {sum(not r.done for r in requests)} of 4 calls "
          f"not done", flush=True)
    if how == "explicit":
        MPI.Finalize()
        print(f"rank {rank}: finalized, {sum(r.done for r in requests)} of 4 done",
              flush=True)


def main(argv):
    if argv[0] == "error":
        step = int(argv[argv.index("--step") + 1]) if "--step" in argv else 2
        if step == 0 and argv[2] != "first":   # "last" counts the call before's transfers
            sys.exit("faults.py: --step 0 hits the first call, where only 'first' applies")
        error_job(argv[1], argv[2], argv[3], "--device" in argv,
                  "raise" if "--raise" in argv else "abort", step, "--started" in argv)
    elif argv[0] == "kill":
        kill_job(argv[1])
    elif argv[0] == "stall":
        stall_job(float(argv[1]))
    elif argv[0] == "finalize":
        finalize_job(argv[1])
    else:
        raise SystemExit(f"unknown job {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])


# ---------------------------------------------------------------------------
# launching a job (used by tests/test_faults.py)
# ---------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


class Job:
    """A finished (or killed) ``mpiexec`` job: exit code, output, seconds."""

    def __init__(self, rc, output, seconds, timed_out):
        self.rc, self.output, self.seconds, self.timed_out = rc, output, seconds, timed_out

    def __repr__(self):
        state = "TIMED OUT" if self.timed_out else f"exit {self.rc}"
        return f"<job {state} after {self.seconds:.1f} s>\n{self.output[-6000:]}"


def run_job(ranks: int, args, timeout: float, simulator: bool = False, env=None,
            until: str = None, grace: float = 0.0) -> Job:
    """``mpiexec -n ranks python tests/faults.py ARGS`` (under the CUDA
    simulator's harness with ``simulator``), killed with its whole process
    group after ``timeout`` seconds -- or, with ``until``, ``grace`` seconds
    after that text first appears in its output (a job expected to hang from
    there on: it counts as timed out when it is still running then)."""
    program = ([sys.executable, "tests/cudasim.py", "-m", "tests.faults"] if simulator
               else [sys.executable, "tests/faults.py"])
    full_env = dict(os.environ, **(env or {}))
    if simulator:
        full_env["NUMBA_ENABLE_CUDASIM"] = "1"
    t0 = time.monotonic()
    proc = subprocess.Popen([MPIEXEC, "-n", str(ranks), *program, *map(str, args)], cwd=ROOT,
                            env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines, seen = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if until is not None and until in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = t0 + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if seen.is_set():       # the first sighting's grace: min keeps it
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.05)
    timed_out = proc.poll() is None
    if timed_out:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join()
    return Job(proc.returncode, "".join(lines), time.monotonic() - t0, timed_out)
