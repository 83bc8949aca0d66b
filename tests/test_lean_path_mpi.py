"""The reducer's lean path: a key whose call was one plain MPI_Allreduce
(``algorithm="mpi"``, or ``auto`` deciding dense) repeats it without the
algorithm.  It must give the bits of ``MPI_Allreduce`` for every kind of
``out``, count its calls and bytes like the full path, and stay collectively
compatible with the full path: a rank that falls back (a NaN, another shape)
still meets the others in the same agreement and raises the same error."""
import numpy as np
import pytest
from mpi4py import MPI

import hpccomm
from hpccomm.collectives.transport import allreduce_bytes

from .helpers import (COMM, OUT_MODES, RANK, SIZE, digest, input_and_out, raise_everywhere,
                      rank_data)

pytestmark = pytest.mark.mpi

CONFIGS = [("none", "mpi"), ("onebit", "auto")]   # auto: the built-in defaults send small calls dense


def reference(x, op):
    want = np.empty_like(x)
    COMM.Allreduce(x, want, op=MPI.SUM)
    if op == "mean" and SIZE > 1:
        np.divide(want, want.dtype.type(SIZE), out=want)
    return want


@pytest.mark.parametrize("codec,algorithm", CONFIGS)
@pytest.mark.parametrize("check", ["always", "first"])
@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("out_mode", OUT_MODES)
def test_repeated_dense_calls_have_mpis_bits(codec, algorithm, check, op, out_mode):
    reducer = hpccomm.Allreducer(COMM, codec=codec, algorithm=algorithm, check=check, op=op)
    n, calls = 1001, 5
    results, wants, after_first = [], [], 0
    for step in range(calls):
        x, out = input_and_out(n, step, out_mode)
        want = reference(np.ascontiguousarray(x), op)
        before = reducer.stats.t_total
        got = reducer(x, key="g", out=out)
        if out is not None:
            assert got is out
        # stats.last is this call's, whichever path took it
        assert reducer.stats.last.t_total == pytest.approx(reducer.stats.t_total - before,
                                                           rel=1e-9, abs=1e-12)
        results.append(digest(got))
        wants.append(digest(want))
        after_first = after_first or reducer.stats.bytes_sent
    assert results == wants
    last = reducer.stats.last
    assert reducer.stats.calls == calls
    # the first call may carry one-time traffic (auto broadcasts its profile once)
    assert reducer.stats.bytes_sent - after_first == (calls - 1) * allreduce_bytes(n * 4, SIZE)
    assert last.bytes_sent == allreduce_bytes(n * 4, SIZE)
    assert (last.key, last.n, last.nbytes) == ("g", n, n * 4)
    if algorithm == "auto":
        assert last.extra["auto"] == "dense"
    assert reducer.state_dict()["keys"]["g"]["step"] == calls


@pytest.mark.mpi(min_size=2)
def test_nan_on_one_rank_after_lean_calls_is_raised_everywhere():
    """onebit refuses NaN (``nonfinite="raise"``): the rank that has one
    leaves the lean path, the others stay on it, and all raise alike -- and
    the key goes on working afterwards."""
    reducer = hpccomm.Allreducer(COMM, codec="onebit", algorithm="auto")
    x = rank_data(777)
    for _ in range(3):
        reducer(x, key="g")
    bad = x.copy()
    if RANK == SIZE - 1:
        bad[5] = np.nan
    (name, message), same = raise_everywhere(lambda: reducer(bad, key="g"))
    assert same and name == "NonFiniteError", message
    assert digest(reducer(x, key="g")) == digest(reference(x, "sum"))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bad,error,text", [("longer", "ValueError",
                                             "key 'g' names a tensor of 500 elements, this "
                                             "call has 501"),
                                            ("strided", "ValueError", "not C-contiguous"),
                                            ("list key", "TypeError",
                                             "key must be a string, not list"),
                                            ("float16", "ConsistencyError", "dtype=float16")])
@pytest.mark.parametrize("algorithm,path", [("auto", "dense"), ("twoshot", "kernels")])
def test_bad_input_on_one_rank_after_lean_calls_is_raised_everywhere(bad, error, text,
                                                                     algorithm, path):
    """After repeated calls, dense (the lean path) or compressed (the
    algorithm's plan, tests/test_planned_path_mpi.py), one rank's bad input
    takes the general path and meets the others in the same agreement."""
    reducer = hpccomm.Allreducer(COMM, codec="onebit", algorithm=algorithm)
    x = rank_data(500)
    for _ in range(3):
        reducer(x, key="g")
    assert reducer.repeat_path("g") == path
    y, key = x, "g"
    if RANK == 0:
        if bad == "list key":
            key = ["g"]
        else:
            y = {"longer": rank_data(501), "strided": rank_data(1000)[::2],
                 "float16": x.astype(np.float16)}[bad]
    (name, message), same = raise_everywhere(lambda: reducer(y, key=key))
    assert same and name == error and text in message, message


def test_reset_and_load_state_dict_keep_the_step_count_right():
    reducer = hpccomm.Allreducer(COMM, codec="none", algorithm="mpi")
    x = rank_data(64)
    for _ in range(3):
        reducer(x, key="g")
    saved = reducer.state_dict()
    reducer.reset("g")
    reducer(x, key="g")
    assert reducer.state_dict()["keys"]["g"]["step"] == 1
    reducer.load_state_dict(saved)
    reducer(x, key="g")
    assert reducer.state_dict()["keys"]["g"]["step"] == 4
