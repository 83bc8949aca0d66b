"""The reducer's plan of a repeated compressed call: a key whose call ran
``twoshot`` with fixed-size packets in one segment repeats it through the
algorithm's plan (:meth:`hpccomm.collectives.twoshot.TwoShot.repeat_plan`).
It must give the bits, residuals, step counts and byte counts of the general
path for every kind of ``out``, and stay collectively compatible with it: a
rank that falls back (another ``out``, a NaN; another shape:
tests/test_lean_path_mpi.py) still meets the others in the same collectives
and raises the same error."""
import numpy as np
import pytest

import hpccomm

from .helpers import (COMM, OUT_MODES, RANK, SIZE, digest, input_and_out, raise_everywhere,
                      rank_data)

pytestmark = pytest.mark.mpi

#: codecs with fixed-size packets and an owner step
PLANNED = ["onebit", "fp16", "bf16", "qsgd", "terngrad", "fp8", "randk"]
#: those whose plan runs their kernels on packets laid out once
LAID_OUT = ["onebit", "fp16", "bf16", "terngrad", "qsgd", "randk"]


def planned_path(codec):
    """What ``repeat_path`` reports for a planned key of ``codec``."""
    if SIZE == 1:
        return None
    return "kernels" if codec in LAID_OUT else "plan"


def run(reducer, steps, n=1001, out_mode="new", key="g"):
    """``steps`` calls of one key; digests of results and the saved residuals."""
    got = []
    for step in range(steps):
        x, out = input_and_out(n, step, out_mode)
        res = reducer(x, key=key, out=out)
        if out is not None:
            assert res is out
        got.append(digest(res))
    saved = reducer.state_dict()["keys"][key]
    return got, {k: digest(v) for k, v in saved["residuals"].items()}, saved["step"]


@pytest.mark.parametrize("codec", PLANNED)
@pytest.mark.parametrize("ef", [True, False])
@pytest.mark.parametrize("check", ["always", "first"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_repeated_calls_take_the_plan_with_the_general_paths_bits(codec, ef, check, op):
    """Against ``fused=False`` (the three-step reference, never planned):
    results, residuals, steps and bytes, call by call."""
    runs, stats = {}, {}
    for fused in (True, False):
        reducer = hpccomm.Allreducer(COMM, codec=codec, algorithm="twoshot", fused=fused,
                                     error_feedback=ef, check=check, op=op)
        runs[fused] = run(reducer, 5)
        stats[fused] = (reducer.stats.calls, reducer.stats.bytes_sent, reducer.stats.bytes_recv,
                        reducer.stats.last.modelled)
        if fused:
            assert reducer.repeat_path("g") == planned_path(codec)
    assert runs[True] == runs[False]
    assert stats[True] == stats[False]


@pytest.mark.parametrize("codec", LAID_OUT)
@pytest.mark.parametrize("ef", [True, False])
def test_laid_out_packets_of_several_chunks(codec, ef):
    """The laid-out plan with every rank's chunk non-empty (onebit's
    1-D columns are 4096 long: ``n`` spans several) and odd lengths:
    results, residuals, steps and bytes of the reference."""
    runs, stats = {}, {}
    n = 4096 * SIZE + 37
    for fused in (True, False):
        reducer = hpccomm.Allreducer(COMM, codec=codec, algorithm="twoshot", fused=fused,
                                     error_feedback=ef)
        runs[fused] = run(reducer, 4, n=n, out_mode="separate")
        stats[fused] = (reducer.stats.calls, reducer.stats.bytes_sent, reducer.stats.bytes_recv)
        if fused:
            assert reducer.repeat_path("g") == planned_path(codec)
    assert runs[True] == runs[False]
    assert stats[True] == stats[False]


@pytest.mark.parametrize("options,path", [({"bits": 2, "bucket": 7, "norm": "max"}, "kernels"),
                                          ({"bits": 8, "bucket": 100}, "kernels"),
                                          ({"bits": 2, "bucket": 7, "elias": True}, "plan")])
@pytest.mark.parametrize("ef", [True, False])
def test_qsgd_variants_through_the_plan(options, path, ef):
    """``qsgd``'s bit widths, bucket sizes and norms run their kernels on laid-out
    packets (Elias packets vary in size: the plan in slots), with the
    reference's results, residuals, steps and bytes (the slots' for Elias);
    chunks of odd byte lengths leave the received scales unaligned."""
    runs, stats = {}, {}
    for fused in (True, False):
        reducer = hpccomm.Allreducer(COMM, codec="qsgd", algorithm="twoshot", fused=fused,
                                     error_feedback=ef, **options)
        runs[fused] = run(reducer, 4, n=1001 + 4 * SIZE, out_mode="separate")
        stats[fused] = (reducer.stats.calls, reducer.stats.bytes_sent, reducer.stats.bytes_recv)
        if fused and SIZE > 1:
            assert reducer.repeat_path("g") == path
    assert runs[True] == runs[False]
    if path == "plan" and SIZE > 1:
        codec = hpccomm.get_codec("qsgd", **options)
        assert stats[True][1] == 4 * slot_bytes(codec, 1001 + 4 * SIZE)
    else:
        assert stats[True] == stats[False]


@pytest.mark.parametrize("out_mode", OUT_MODES)
def test_every_kind_of_out(out_mode):
    """``out`` the input itself or overlapping it runs the general path, a
    separate one the plan: the same bits either way."""
    got = {}
    for fused in (True, False):
        reducer = hpccomm.Allreducer(COMM, codec="onebit", algorithm="twoshot", fused=fused)
        got[fused] = run(reducer, 4, out_mode=out_mode)
    assert got[True] == got[False]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", ["qsgd", "onebit", "bf16"])
def test_a_rank_on_the_general_path_meets_the_others_on_the_plan(codec):
    """Rank 0 passes an ``out`` that overlaps its input (the general path,
    which checks the headers of the packets the plan sent it), the others a
    separate one (the plan): the same collectives, the reference's bits."""
    got = {}
    for fused in (True, False):
        reducer = hpccomm.Allreducer(COMM, codec=codec, algorithm="twoshot", fused=fused,
                                     error_feedback=True)
        got[fused] = run(reducer, 4, n=4096 * SIZE + 37,
                         out_mode="overlapping" if RANK == 0 else "separate")
    assert got[True] == got[False]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec,ef", [("onebit", True), ("qsgd", False),   # the check deferred /
                                       ("fp16", True), ("bf16", False),    # made before
                                       ("terngrad", True), ("terngrad", False),
                                       ("randk", True), ("randk", False)])
def test_nan_on_one_rank_after_planned_calls_is_raised_everywhere(codec, ef):
    """A NaN on one rank: its fused encode counts it (onebit with error
    feedback: the check waits for the encode) or the reducer's scan finds it
    (qsgd without): every rank raises the same error, and the key goes on
    working with the reference's bits."""
    reducer = hpccomm.Allreducer(COMM, codec=codec, algorithm="twoshot", error_feedback=ef)
    ref = hpccomm.Allreducer(COMM, codec=codec, algorithm="twoshot", fused=False,
                             error_feedback=ef)
    x = rank_data(4096 * SIZE + 37)
    for _ in range(3):
        assert digest(reducer(x, key="g")) == digest(ref(x, key="g"))
    assert reducer.repeat_path("g") == planned_path(codec)
    bad = x.copy()
    if RANK == SIZE - 1:
        bad[5] = bad[-3] = np.nan    # the first and the last chunk
    (name, message), same = raise_everywhere(lambda: reducer(bad, key="g"))
    assert same and name == "NonFiniteError" and f"rank {SIZE - 1}" in message, message
    assert raise_everywhere(lambda: ref(bad, key="g"))[0] == (name, message)
    assert digest(reducer(x, key="g")) == digest(ref(x, key="g"))


def test_reset_and_load_state_dict_drop_the_plan():
    """The plan holds the key's state: after ``reset`` and ``load_state_dict``
    the next calls go on from the right residuals and step."""
    reducer = hpccomm.Allreducer(COMM, codec="onebit", algorithm="twoshot")
    ref = hpccomm.Allreducer(COMM, codec="onebit", algorithm="twoshot", fused=False)
    x = rank_data(300)
    for _ in range(3):
        assert digest(reducer(x, key="g")) == digest(ref(x, key="g"))
    saved, ref_saved = reducer.state_dict(), ref.state_dict()
    reducer.reset("g")
    ref.reset("g")
    assert reducer.repeat_path("g") is None
    assert digest(reducer(x, key="g")) == digest(ref(x, key="g"))
    reducer.load_state_dict(saved)
    ref.load_state_dict(ref_saved)
    for _ in range(2):
        assert digest(reducer(x, key="g")) == digest(ref(x, key="g"))
    assert reducer.state_dict()["keys"]["g"]["step"] == 5


def test_only_small_calls_get_a_plan():
    """A plan keeps its buffers with the key: packets of more than
    ``PLAN_BYTES`` (all chunks together) take the general path every call."""
    from hpccomm.collectives.twoshot import PLAN_BYTES

    reducer = hpccomm.Allreducer(COMM, codec="fp16", algorithm="twoshot")
    small, large = PLAN_BYTES // 4, PLAN_BYTES   # 2-byte codes: under and over the limit
    for key, n in (("small", small), ("large", large)):
        for _ in range(2):
            reducer(rank_data(n), key=key)
    assert reducer.repeat_path("small") == planned_path("fp16")
    assert reducer.repeat_path("large") is None


#: codecs whose packets vary in size, with options, and the repeated call's
#: path: slots of their capacity (no counts sent first), the slot kernels
#: where they apply (topk's and dgc's where the selection is the exact top-k:
#: dgc's sample is the whole chunk below 2 / ratio elements, here for its
#: default ratio, 0.001, not for 0.1; threshold's below 65536 elements;
#: adaptive's where its columns make one group: a vector's one column sits in
#: the last rank's chunk)
SLOTTED = [("topk", {"ratio": 0.05}, "kernels"), ("topk", {"exact": True}, "kernels"),
           ("dgc", {}, "kernels"), ("dgc", {"ratio": 0.1}, "plan"),
           ("threshold", {}, "kernels"), ("threshold", {"tau": 0.5, "max_ratio": 0.05}, "kernels"),
           ("adaptive", {}, "kernels")]


def slot_bytes(codec, n):
    """Bytes this rank counts as sent per call in slots: its slots to the
    others in the all-to-all, and the others' owner slots in the allgather
    (the transport counts an allgather's bytes as it arrives)."""
    from hpccomm.collectives.base import chunk_bounds

    b = chunk_bounds(n, SIZE, codec.align((n,)))
    caps = [codec.capacity_for(int(b[j + 1] - b[j]), (n,)) for j in range(SIZE)]
    return 2 * (sum(caps) - caps[RANK])


@pytest.mark.parametrize("codec,options,path", SLOTTED)
@pytest.mark.parametrize("ef", [True, False])
@pytest.mark.parametrize("check", ["always", "first"])
def test_variable_packets_travel_in_slots_with_the_reference_bits(codec, options, path, ef,
                                                                  check):
    """Against ``fused=False`` (counts first, then the packets): results,
    residuals and steps, call by call, the plan's or slot kernels' alike;
    the bytes those of the slots."""
    runs = {}
    n = 1001 + 4 * SIZE
    for fused in (True, False):
        reducer = hpccomm.Allreducer(COMM, codec=codec, algorithm="twoshot", fused=fused,
                                     error_feedback=ef, check=check, **options)
        runs[fused] = run(reducer, 5, n=n, out_mode="separate")
        if fused:
            assert reducer.repeat_path("g") == (None if SIZE == 1 else path)
            if SIZE > 1:
                assert reducer.stats.bytes_sent == 5 * slot_bytes(reducer.codec, n)
    assert runs[True] == runs[False]


@pytest.mark.parametrize("ef", [True, False])
def test_adaptive_columns_of_a_matrix_in_slots(ef):
    """A matrix's columns (its last dimension) spread over every rank's
    chunk: the slot kernels' results, residuals and steps against
    ``fused=False``, with the call's random streams: 64 rows drawn of each
    column of 100.  (Its slots hold 26 entries a column; with the default
    ``excess=4`` they would hold more than the float32, and there would be
    no slots.)"""
    shape = (4 * SIZE + 3, 100)
    got = {}
    for fused in (True, False):
        reducer = hpccomm.Allreducer(COMM, codec="adaptive", algorithm="twoshot", fused=fused,
                                     error_feedback=ef, proportion=8, excess=1)
        steps = []
        for step in range(4):
            x = rank_data(int(np.prod(shape)), seed=step).reshape(shape)
            steps.append(digest(reducer(x, key="w")))
        saved = reducer.state_dict()["keys"]["w"]
        got[fused] = steps, {k: digest(v) for k, v in saved["residuals"].items()}
        if fused:
            assert reducer.repeat_path("w") == (None if SIZE == 1 else "kernels")
    assert got[True] == got[False]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec,options", [("topk", {"ratio": 0.05}), ("threshold", {}),
                                           ("adaptive", {})])
def test_a_rank_on_the_general_path_meets_the_others_in_slots(codec, options):
    """Rank 0's ``out`` overlaps its input (the general path, in the same
    slots), the others' does not (the plan): the reference's bits."""
    got = {}
    for fused in (True, False):
        reducer = hpccomm.Allreducer(COMM, codec=codec, algorithm="twoshot", fused=fused,
                                     error_feedback=True, **options)
        got[fused] = run(reducer, 4, n=1001 + 4 * SIZE,
                         out_mode="overlapping" if RANK == 0 else "separate")
    assert got[True] == got[False]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec,options", [("topk", {"ratio": 0.05}), ("threshold", {}),
                                           ("adaptive", {})])
@pytest.mark.parametrize("ef", [True, False])
def test_nan_on_one_rank_in_the_slot_kernels_is_raised_everywhere(codec, options, ef):
    """The slot kernels count a NaN in their encode: every rank raises the
    same error, and the key goes on with the reference's bits."""
    reducer = hpccomm.Allreducer(COMM, codec=codec, algorithm="twoshot", error_feedback=ef,
                                 **options)
    ref = hpccomm.Allreducer(COMM, codec=codec, algorithm="twoshot", fused=False,
                             error_feedback=ef, **options)
    x = rank_data(1001 + 4 * SIZE)
    for _ in range(3):
        assert digest(reducer(x, key="g")) == digest(ref(x, key="g"))
    assert reducer.repeat_path("g") == "kernels"
    bad = x.copy()
    if RANK == SIZE - 1:
        bad[5] = bad[-3] = np.nan
    (name, message), same = raise_everywhere(lambda: reducer(bad, key="g"))
    assert same and name == "NonFiniteError" and f"rank {SIZE - 1}" in message, message
    assert raise_everywhere(lambda: ref(bad, key="g"))[0] == (name, message)
    assert digest(reducer(x, key="g")) == digest(ref(x, key="g"))


def test_slots_only_where_they_are_small_and_no_larger_than_float32():
    """A slot holds the codec's worst case: a call whose slots would take
    more than its float32, or more than ``SLOT_BYTES``, sends its packets as
    they are (counts first)."""
    from hpccomm.collectives.twoshot import SLOT_BYTES

    # a word per element at most, and the fields: more than the float32
    reducer = hpccomm.Allreducer(COMM, codec="threshold", algorithm="twoshot", max_ratio=1.0)
    topk = hpccomm.Allreducer(COMM, codec="topk", algorithm="twoshot")
    large = SLOT_BYTES * 100 // 8 + 1000       # 8-byte entries of 1 %: over the limit
    for _ in range(2):
        reducer(rank_data(1001), key="g")
        topk(rank_data(large), key="large")
        topk(rank_data(large // 4), key="small")
    assert reducer.repeat_path("g") is None
    assert topk.repeat_path("large") is None
    assert topk.repeat_path("small") == (None if SIZE == 1 else "kernels")
