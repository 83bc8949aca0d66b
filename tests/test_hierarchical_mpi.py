"""``hierarchical``: dense inside a node, the codec across nodes.  Nodes are
forced with ``nodes=`` (2 hosts at P = 4, 3 hosts of unequal sizes at P = 5,
...), and the result must equal a single-process simulation of the three
steps, bit for bit, on every rank."""
import numpy as np
import pytest

import hpccomm
from hpccomm import reference

from .helpers import COMM, SIZE, digest, exact_sum, rank_data, same_on_all_ranks
from .test_collectives_mpi import CODEC_PARAMS, SEED, make_codec

pytestmark = pytest.mark.mpi

LAYOUTS = {  # node id per rank, per communicator size
    1: [[0]], 2: [[0, 0], [0, 1]], 3: [[0, 0, 1], [0, 1, 1], [5, 5, 5]],
    4: [[0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 0, 1]], 5: [[0, 0, 1, 1, 2], [2, 0, 2, 1, 0]],
}


def simulate_hierarchical(codec, outer, xs, nodes, seed=SEED):
    """The three steps in one process (:mod:`hpccomm.reference`): node sums
    in rank order, the outer algorithm per share over the nodes (ordered by
    lowest rank), the gather."""
    return reference.simulate(codec, "hierarchical", xs, (xs[0].size,), seed=seed,
                              nodes=nodes, outer=outer)


def layouts():
    return [tuple(lay) for lay in LAYOUTS.get(SIZE, [[r // 2 for r in range(SIZE)]])]


@pytest.mark.parametrize("nodes", layouts())
@pytest.mark.parametrize("codec,outer", [("onebit", "twoshot"), ("qsgd", "twoshot"),
                                         ("topk", "allgather"), ("terngrad", "twoshot"),
                                         ("bf16", "allgather")])
@pytest.mark.parametrize("n", [0, 1, 7, 1000, 4097])
def test_matches_single_process_simulation(codec, outer, nodes, n):
    x = rank_data(n, seed=5)
    reducer = hpccomm.Allreducer(COMM, codec=codec, algorithm="hierarchical", outer=outer,
                                 nodes=nodes, seed=SEED, error_feedback=False,
                                 **CODEC_PARAMS.get(codec, {}))
    got = reducer(x, key="h")
    xs = COMM.allgather(x)
    want = simulate_hierarchical(make_codec(codec), outer, xs, list(nodes))
    assert same_on_all_ranks(got)
    assert digest(got) == digest(want)


@pytest.mark.parametrize("nodes", layouts())
def test_none_codec_is_exact_on_integers(nodes):
    x = rank_data(3001, integers=True)
    got = hpccomm.Allreducer(COMM, codec="none", algorithm="hierarchical", nodes=nodes)(x)
    np.testing.assert_array_equal(got, exact_sum(3001, integers=True).astype(np.float32))


@pytest.mark.mpi(min_size=2)
def test_error_feedback_and_state_dict_resume_bit_for_bit():
    nodes = tuple(r % 2 for r in range(SIZE))     # two nodes: the codec runs across them
    mk = lambda: hpccomm.Allreducer(COMM, codec="onebit", algorithm="hierarchical",  # noqa: E731
                                    nodes=nodes)
    a = mk()
    for step in range(3):
        a(rank_data(2000, seed=step), key="k")
    saved = a.state_dict()
    assert any(k.startswith("share") for k in saved["keys"]["k"]["residuals"])
    want = digest(a(rank_data(2000, seed=9), key="k"))
    b = mk()
    b.load_state_dict(saved)
    assert digest(b(rank_data(2000, seed=9), key="k")) == want


def test_bad_nodes_option_is_the_same_error_everywhere():
    from .helpers import raise_everywhere

    r = hpccomm.Allreducer(COMM, codec="onebit", algorithm="hierarchical", nodes=(0,) * (SIZE + 1))
    (name, message), same = raise_everywhere(lambda: r(rank_data(10)))
    assert same and name == "ValueError" and "nodes lists" in message


@pytest.mark.mpi(min_size=2)
def test_calls_back_to_back_with_growing_and_shrinking_sizes():
    """The node's shared block is written and read without a closing barrier
    (alternate calls use alternate halves) and grows with ``n``: successive
    calls of changing sizes, then the same calls again with local rank 1 of
    each node slow to read what the others wrote (with one half, the others'
    next call overwrites it), each equal to the simulation."""
    import time

    comm = COMM.Dup()            # its own private communicator: its own node layout
    nodes = tuple(r // 2 for r in range(SIZE))
    r = hpccomm.Allreducer(comm, codec="bf16", algorithm="hierarchical", outer="allgather",
                           nodes=nodes, seed=SEED, check="never")   # no agreement per call
    sizes = [10, 5000, 4999, 20000, 7, 20000, 3, 40000, 1]
    xs = [rank_data(n, seed=100 + step) for step, n in enumerate(sizes)]
    wants = [simulate_hierarchical(make_codec("bf16"), "allgather", COMM.allgather(x),
                                   list(nodes)) for x in xs]
    got = [r(x, key=str(x.size)) for x in xs]     # grows the block; the keys' first calls agree
    if COMM.rank % 2 == 1:
        lay, fence = r.algorithm._layout, r.algorithm._layout.fence
        lay.fence = lambda: (fence(), time.sleep(0.02))
    got += [r(x, key=str(x.size)) for x in xs]    # nothing else synchronises these calls
    for step, (g, w) in enumerate(zip(got, wants + wants)):
        assert digest(g) == digest(w), (step, sizes[step % len(sizes)])
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_no_shared_memory_is_the_same_error_everywhere():
    from hpccomm.collectives import hierarchical

    from .helpers import raise_everywhere

    comm = COMM.Dup()            # a fresh private communicator: a fresh node block
    saved = hierarchical._SHM_DIR
    if COMM.rank == 0:
        hierarchical._SHM_DIR = "/nonexistent-hpccomm-dir"
    try:
        r = hpccomm.Allreducer(comm, codec="none", algorithm="hierarchical",
                               nodes=tuple(q // 2 for q in range(SIZE)))
        (name, message), same = raise_everywhere(lambda: r(rank_data(1000)))
    finally:
        hierarchical._SHM_DIR = saved
    assert same and name == "MemoryError" and "shared memory" in message
    # the next call makes the block and is right
    np.testing.assert_array_equal(r(rank_data(1000, integers=True)),
                                  exact_sum(1000, integers=True).astype(np.float32))
    comm.Free()
