"""The benchmarks' timing under MPI: every timed call starts after a barrier,
so that a rank that falls behind between calls (its bookkeeping, a page
fault, the scheduler) does not lengthen the other ranks' next call.  Here
the last rank sleeps ``LAG`` seconds outside the timed region before each
call; without the barrier the others' calls would wait that long inside
it, and the slowest rank's median would be about ``LAG``."""
import time

import numpy as np
import pytest

from hpccomm.bench.allreduce import Timed
from hpccomm.bench.harness import slowest_median, slowest_rank

from .helpers import COMM, RANK, SIZE

# narrow: the benchmarks' harness, a layer above the collectives (at 1-3 ranks)
pytestmark = [pytest.mark.mpi, pytest.mark.narrow]

#: what the last rank sleeps before each call, outside the timed region
LAG = 0.15
CALLS = 3


def _lagging():
    """Sleep ``LAG`` on the last rank (of more than one)."""
    if SIZE > 1 and RANK == SIZE - 1:
        time.sleep(LAG)


class _Lagging(Timed):
    """A one-number ``MPI_Allreduce``, whose last rank lags after each step."""

    def __init__(self, iters):
        super().__init__(COMM, np.ones(1, np.float32), iters)
        self.call = lambda: COMM.Allreduce(self.x, self.out)

    def after(self, it):
        _lagging()


def test_each_timed_step_starts_after_a_barrier():
    case = _Lagging(CALLS)
    for _ in range(CALLS):
        case.step()
    slowest = slowest_rank(COMM, case.times)
    assert case.it == CALLS and float(case.out[0]) == SIZE
    assert case.span[0] <= case.span[1]
    assert np.median(slowest) < LAG / 2, slowest


def test_slowest_median_starts_each_call_after_a_barrier():
    """The lag here is inside ``fn`` on the lagging rank, after its part of
    the collective, and taken off its own time through ``excluded``."""
    slept = [0.0]
    buf, out = np.ones(1, np.float32), np.empty(1, np.float32)

    def fn():
        COMM.Allreduce(buf, out)
        t0 = time.perf_counter()
        _lagging()
        slept[0] += time.perf_counter() - t0

    median = slowest_median(COMM, fn, CALLS, excluded=lambda: slept[0])
    assert float(out[0]) == SIZE
    assert median < LAG / 2, median
