"""hpccomm's private communicators live exactly as long as the user's:
MPICH reuses a freed communicator's handle, and a cache by handle handed the
old group's duplicate to the next communicator (wrong sums, or a hang)."""
import numpy as np
import pytest
from mpi4py import MPI

import hpccomm
from hpccomm.communicators import comm_cache, private_comm, ranks_on_node

from .helpers import COMM, RANK, SIZE

pytestmark = pytest.mark.mpi


def expected_sum(members):
    return float(sum(r + 1 for r in members))


@pytest.mark.parametrize("codec,algorithm", [("none", "mpi"), ("onebit", "twoshot"),
                                             ("none", "hierarchical")])
def test_a_freed_communicators_successor_gets_its_own_group(codec, algorithm):
    c = COMM.Split(RANK % 2, key=RANK)
    opts = {"nodes": (0,) * c.Get_size()} if algorithm == "hierarchical" else {}
    hpccomm.Allreducer(c, codec=codec, algorithm=algorithm, **opts)(np.ones(64, np.float32))
    hpccomm.sparse_allreduce((np.array([RANK % 8]), np.ones(1, np.float32), 8), c)
    c.Free()
    d = COMM.Split(int(RANK < 2), key=RANK)    # often the handle c had
    members = [r for r in range(SIZE) if (r < 2) == (RANK < 2)]
    x = np.full(1000, RANK + 1, np.float32)
    opts = {"nodes": tuple(q // 2 for q in range(d.Get_size()))} if algorithm == "hierarchical" else {}
    got = hpccomm.Allreducer(d, codec=codec, algorithm=algorithm, **opts)(x)
    if codec == "none":
        np.testing.assert_array_equal(got, np.full(1000, expected_sum(members), np.float32))
    else:   # onebit of a constant vector is exact
        np.testing.assert_allclose(got, expected_sum(members), rtol=1e-6)
    dense = hpccomm.sparse_allreduce((np.array([0]), np.ones(1, np.float32), 8), d)
    assert list(dense) == [len(members)] + [0.0] * 7
    d.Free()


def test_the_private_communicator_is_cached_on_the_communicator_and_freed_with_it():
    c = COMM.Dup()
    p = private_comm(c)
    assert private_comm(c) is p and p.Get_size() == c.Get_size()
    e = c.Dup()                       # a duplicate of the user's communicator gets its own
    assert private_comm(e) is not p
    assert "private" in comm_cache(c)
    c.Free()
    with pytest.raises(Exception):      # freed with c
        p.Get_size()
    e.Free()


def test_the_node_count_is_asked_once_and_dropped_with_the_communicator():
    """``ranks_on_node`` splits the communicator once (a collective every
    reducer's first call needs) and keeps the count on it; freeing the
    communicator drops the count and still frees what was cached before it
    (the private duplicate)."""
    c = COMM.Dup()
    p = private_comm(c)
    node = c.Split_type(MPI.COMM_TYPE_SHARED)
    expected = node.Get_size()
    node.Free()
    assert ranks_on_node(c) == expected
    assert comm_cache(c)["ranks_on_node"] == expected
    comm_cache(c)["ranks_on_node"] = -7          # kept: not asked of MPI again
    assert ranks_on_node(c) == -7
    c.Free()
    with pytest.raises(Exception):               # the duplicate went with c
        p.Get_size()
