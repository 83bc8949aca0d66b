"""The repeated dense call with parts of its work taken out, to see what
each costs against the bare ``MPI_Allreduce`` and the least keyed call of
``dense_floor.py`` (timed the same way: a barrier, one call of each case in
turn, rotating; slowest rank, median of 2000):

- ``reducer``: ``hpccomm.Allreducer`` as it is (``auto`` sending dense,
  ``check="first"``);
- ``fast``: the same checks, clocks and statistics in one method called from
  ``__call__`` (no ``_call``, ``_lean_call`` and ``allreduce_sum`` layers; the
  transport's wait rule and the overlap test written out);
- ``untimed``: ``fast`` without its clocks and statistics;
- ``unvalidated``: ``fast`` without the checks of ``x`` and ``out``.

None of these variants is in hpccomm: ``untimed`` and ``unvalidated`` drop
what a call promises (its statistics, a clean error for a bad ``out``).

    mpiexec -n 2 -bind-to core python docs/data/i33/dense_variants.py
"""
import os
import sys
import time

import numpy as np
from mpi4py import MPI
import hpccomm
from hpccomm import core, requests
from hpccomm.collectives import transport
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dense_floor as F

_now = time.perf_counter
IN_PLACE = MPI.IN_PLACE
SUM = MPI.SUM
ndarray = np.ndarray
_interval = transport._interval

class Fast(hpccomm.Allreducer):
    TIMED = True
    VALID = True
    def __call__(self, x, key=None, *, out=None, layout=None):
        requests.drain()
        if type(key) is str and type(x) is ndarray and layout is None:
            lean = self._lean.get(key)
            if lean is not None and x.shape == lean.shape and x.dtype is lean.dtype:
                result = (self._dense(lean, x, out) if lean.plan is None
                          else self._planned_call(lean, x, out))
                if result is not None:
                    return result
        return self._call(x, key, out, layout)

    def _dense(self, lean, x, out):
        t0 = _now() if self.TIMED else 0.0
        if self.VALID and not x.flags.c_contiguous:
            return None
        if out is None:
            res, send = np.empty(lean.shape, lean.dtype), x
        elif out is x:
            res, send = x, IN_PLACE
        elif not self.VALID:
            res, send = out, x
        elif type(out) is ndarray and out.shape == lean.shape and out.dtype is lean.dtype:
            flags = out.flags
            if not (flags.c_contiguous and flags.writeable) or (
                    not (flags.owndata and x.flags.owndata) and np.may_share_memory(out, x)):
                return None
            res, send = out, x
        else:
            return None
        if lean.scan and core.count_nonfinite(x.reshape(-1)):
            return None
        if lean.desc is not None:
            core.agree(self.comm, lean.desc)
        t1 = _now() if self.TIMED else 0.0
        try:
            if _interval() is None:
                self._comm.Allreduce(send, res, SUM)
            else:
                transport.allreduce_sum(self._comm, send, res)
        except Exception as exc:
            core.stranded(exc, self._comm, self.on_error,
                     lambda: self._call_text(x.size, lean.key, lean.state.step))
            raise
        t2 = _now() if self.TIMED else 0.0
        if self.op == "mean":
            np.divide(res, res.dtype.type(self.size), out=res)
        lean.state.step += 1
        self._states.move_to_end(lean.key)
        if self.TIMED:
            self.stats.record_repeat(lean.template, t2 - t1, t2 - t0)
        return res

class Untimed(Fast):
    TIMED = False
class Unvalidated(Fast):
    VALID = False
comm = MPI.COMM_WORLD
def measure(nbytes, iters):
    n = nbytes // 4
    x = np.random.default_rng([comm.rank, n]).standard_normal(n).astype(np.float32)
    outs = [np.empty_like(x) for _ in range(6)]
    reducer = hpccomm.Allreducer(comm, codec="onebit", algorithm="auto", check="first")
    fast = Fast(comm, codec="onebit", algorithm="auto", check="first")
    unt = Untimed(comm, codec="onebit", algorithm="auto", check="first")
    unv = Unvalidated(comm, codec="onebit", algorithm="auto", check="first")
    least = F.Least(comm, x)
    for _ in range(3):
        reducer(x, "k", out=outs[1]); fast(x, "k", out=outs[3]); unt(x, "k", out=outs[4]); unv(x, "k", out=outs[5])
    assert fast.repeat_path("k") == "dense"
    cases = [lambda: comm.Allreduce(x, outs[0], op=SUM),
             lambda: reducer(x, "k", out=outs[1]),
             lambda: least(x, "k", out=outs[2]),
             lambda: fast(x, "k", out=outs[3]),
             lambda: unt(x, "k", out=outs[4]),
             lambda: unv(x, "k", out=outs[5])]
    for _ in range(200):
        for f in cases: f()
    times = np.empty((len(cases), iters))
    for i in range(iters):
        for j in range(len(cases)):
            c = (i + j) % len(cases)
            comm.Barrier()
            t = _now(); cases[c](); times[c, i] = _now() - t
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    return np.median(slowest, axis=1)
for nbytes in [4096, 65536]:
    t = measure(nbytes, 2000)
    if comm.rank == 0:
        print(nbytes, " ".join(f"{k} {v*1e6:.2f} ({t[0]/v:.2f})" for k, v in zip(["raw", "reducer", "least", "fast", "untimed", "unvalidated"], t)), flush=True)
