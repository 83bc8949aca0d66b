"""The transport: every pattern, blocking and non-blocking, its byte
accounting, and messages beyond the int range.

``count_limit`` is lowered to a few bytes in most tests, so the derived-datatype
path that carries counts beyond ``2**31 - 1`` runs at every rank count on small
data; the test marked ``slow`` moves real packets of more than 2 GiB.
"""
import numpy as np
import pytest

from hpccomm.collectives.transport import INT_MAX, Transport, allreduce_bytes
from hpccomm.stats import CallStats

from .helpers import COMM, RANK, SIZE

pytestmark = pytest.mark.mpi

LIMITS = [None, INT_MAX, 7]  # MPI-4 large counts; derived datatypes beyond 2**31 - 1; beyond 7


def net_for(limit, comm=COMM):
    return Transport(comm, CallStats(), count_limit=limit)


def packet(src, dst, salt=0):
    """The bytes rank ``src`` sends rank ``dst``: a size and pattern of their own."""
    size = (3 * src + 5 * dst + salt) % 23 + (src == dst)  # some empty, some not
    return ((np.arange(size) * 7 + 31 * src + dst + salt) % 251).astype(np.uint8)


@pytest.mark.parametrize("limit", LIMITS)
@pytest.mark.parametrize("known", [False, True])
@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("in_place", [False, True])
def test_alltoallv(limit, known, blocking, in_place):
    """Also with ``in_place`` (MPI reads every packet where it lies, empty
    packets included)."""
    net = net_for(limit)
    sends = [packet(RANK, j) for j in range(SIZE)]
    sizes = [packet(i, RANK).size for i in range(SIZE)] if known else None
    if blocking:
        got = net.alltoallv(sends, sizes, in_place=in_place)
    else:
        req = net.ialltoallv(sends, sizes, in_place=in_place)
        got = req.wait()
        assert req.done and req.test() and req.wait() is got
    for i in range(SIZE):
        np.testing.assert_array_equal(got[i], packet(i, RANK))
    counts = 0 if known or SIZE == 1 else 8 * (SIZE - 1)
    assert net.call.bytes_sent == sum(p.size for j, p in enumerate(sends) if j != RANK) + counts
    assert net.call.bytes_recv == sum(packet(i, RANK).size for i in range(SIZE) if i != RANK) \
        + counts
    assert not net.call.modelled


def test_alltoallv_sends_views_of_one_buffer_without_copying():
    sends = [packet(RANK, j, salt=1) for j in range(SIZE)]
    joined = np.concatenate(sends)
    cuts = np.cumsum([0] + [p.size for p in sends])
    views = [joined[cuts[j]:cuts[j + 1]] for j in range(SIZE)]
    got = net_for(INT_MAX).alltoallv(views)
    for i in range(SIZE):
        np.testing.assert_array_equal(got[i], packet(i, RANK, salt=1))


@pytest.mark.parametrize("limit", LIMITS)
@pytest.mark.parametrize("known", [False, True])
@pytest.mark.parametrize("blocking", [True, False])
def test_allgatherv(limit, known, blocking):
    net = net_for(limit)
    mine = packet(RANK, RANK, salt=2)
    sizes = [packet(i, i, salt=2).size for i in range(SIZE)] if known else None
    got = net.allgatherv(mine, sizes) if blocking else net.iallgatherv(mine, sizes).wait()
    for i in range(SIZE):
        np.testing.assert_array_equal(got[i], packet(i, i, salt=2))
    others = sum(packet(i, i, salt=2).size for i in range(SIZE) if i != RANK)
    counts = 0 if known or SIZE == 1 else 8 * (SIZE - 1)
    assert net.call.bytes_recv == others + counts and net.call.bytes_sent == others + counts
    assert net.call.modelled


def test_allgatherv_refuses_a_packet_of_the_wrong_size():
    sizes = [4] * SIZE
    with pytest.raises(ValueError, match="allgatherv: packet is 5 bytes, expected 4"):
        net_for(INT_MAX).allgatherv(np.zeros(5, np.uint8), sizes)


@pytest.mark.parametrize("limit", [INT_MAX, 5])
@pytest.mark.parametrize("blocking", [True, False])
def test_allreduce_sum_max_and_pieces(limit, blocking):
    net = net_for(limit)
    x = (np.arange(23, dtype=np.int64) * (RANK + 1)) % 17
    out = np.empty_like(x)
    if blocking:
        res = net.allreduce(x, out)
    else:
        res = net.iallreduce(x, out).wait()
    assert res is out
    want = sum((np.arange(23, dtype=np.int64) * (r + 1)) % 17 for r in range(SIZE))
    np.testing.assert_array_equal(out, want)
    y = np.full(11, RANK, dtype=np.float32)
    net.allreduce(y, op="max")  # in place
    np.testing.assert_array_equal(y, np.full(11, SIZE - 1, np.float32))
    moved = allreduce_bytes(x.nbytes, SIZE) + allreduce_bytes(y.nbytes, SIZE)
    assert net.call.bytes_sent == moved and net.call.modelled


def test_allreduce_bytes_model():
    assert allreduce_bytes(1000, 1) == 0
    assert allreduce_bytes(16, 8) == 3 * 16            # recursive doubling: log2(8) rounds
    assert allreduce_bytes(16, 5) == 3 * 16            # ceil(log2 5)
    assert allreduce_bytes(4000, 4) == 2 * 3 * 4000 // 4


@pytest.mark.parametrize("limit", LIMITS)
def test_sendrecv_send_recv_isend_irecv(limit):
    net = net_for(limit)
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    got = net.sendrecv(packet(RANK, right, 3), right, left)
    np.testing.assert_array_equal(got, packet(left, RANK, 3))
    known = net.sendrecv(packet(RANK, right, 4), right, left, packet(left, RANK, 4).size)
    np.testing.assert_array_equal(known, packet(left, RANK, 4))
    if SIZE > 1:  # pairs (0, 1), (2, 3), ...: even sends, odd receives
        if RANK % 2 == 0 and RANK + 1 < SIZE:
            net.send(packet(RANK, RANK + 1, 5), RANK + 1, 9)
        elif RANK % 2 == 1:
            np.testing.assert_array_equal(net.recv(RANK - 1, 9), packet(RANK - 1, RANK, 5))
    buf = np.zeros(64, np.uint8)
    rreq = net.irecv(buf, left, 11)
    sreq = net.isend(packet(RANK, right, 6), right, 11)
    view = rreq.wait()
    sreq.wait()
    np.testing.assert_array_equal(view, packet(left, RANK, 6))
    assert view.base is buf or np.shares_memory(view, buf)


@pytest.mark.parametrize("limit", [INT_MAX, 4])
def test_reduce_bcast_with_a_user_op(limit):
    net = net_for(limit)

    def merge(inbuf, inoutbuf, datatype):  # bytewise max: commutative
        a = np.frombuffer(inbuf, dtype=np.uint8)
        b = np.frombuffer(inoutbuf, dtype=np.uint8)
        np.maximum(a, b, out=b)

    rec = ((np.arange(17) * (RANK + 3)) % 256).astype(np.uint8)
    res = net.reduce_bcast(rec, merge)
    want = np.max([((np.arange(17) * (r + 3)) % 256).astype(np.uint8) for r in range(SIZE)],
                  axis=0)
    np.testing.assert_array_equal(res, want)
    assert net.call.modelled


def test_nonblocking_requests_complete_in_any_order():
    net = net_for(INT_MAX)
    reqs = [net.iallgatherv(packet(RANK, RANK, salt=s)) for s in range(4)]
    while not all(r.test() for r in reqs):
        pass
    for s in reversed(range(4)):
        got = reqs[s].wait()
        for i in range(SIZE):
            np.testing.assert_array_equal(got[i], packet(i, i, salt=s))


@pytest.mark.slow
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("limit", [None, INT_MAX])
def test_messages_beyond_two_gibibytes(limit):
    """A 2 GiB + 13-byte packet to the other rank: alltoallv, sendrecv, and an
    allgatherv whose displacements pass 2**31 -- through the library's large
    counts (None) and through derived datatypes at the C int limit."""
    if SIZE != 2:
        pytest.skip("runs at P = 2 only (memory)")
    big = (1 << 31) + 13
    net = Transport(COMM, CallStats(), count_limit=limit)
    other = 1 - RANK
    buf = np.empty(big + 5, dtype=np.uint8)
    buf[:] = 17 + RANK
    buf[-1] = 99 + RANK
    views = [buf[:5], buf[5:]] if RANK == 0 else [buf[5:], buf[:5]]  # big one to the other
    got = net.alltoallv(views)
    ok_a2a = (got[other].size == big and got[other][0] == 17 + other
              and got[other][-1] == 99 + other and got[RANK].size == 5)
    del got
    echo = net.sendrecv(buf[:big], other, other, big)
    ok_sr = echo.size == big and echo[0] == 17 + other and echo[big - 1] == 17 + other
    del echo
    half = (1 << 30) + 7
    gathered = net.allgatherv(buf[:half])
    ok_ag = all(g.size == half and g[0] == 17 + r and g[-1] == 17 + r
                for r, g in enumerate(gathered))
    del gathered, buf
    oks = COMM.allgather((ok_a2a, ok_sr, ok_ag))
    assert all(all(o) for o in oks), oks
    assert net.call.bytes_sent >= big


def test_zero_size_messages():
    net = net_for(3)
    got = net.alltoallv([np.empty(0, np.uint8)] * SIZE)
    assert all(g.size == 0 for g in got)
    assert all(g.size == 0 for g in net.allgatherv(np.empty(0, np.uint8)))
