"""Sparse allreduce algorithms on real MPI, through both entry points.

Every rank's input is generated from ``(seed, rank)``, so every rank can
compute the exact reference sum locally.  Integer-valued inputs must give
the dense sum exactly; float inputs within the reassociation bound.  Every
result must be bit-identical on every rank.  Collectives first, assertions
after, so a failing rank never leaves the others hanging.
"""
import numpy as np
import pytest

import hpccomm
from hpccomm.codecs.base import HEADER_SIZE, Codec, EncodeContext, register_codec
from hpccomm.collectives.sparse.kylix import factorizations
from hpccomm.errors import ConsistencyError, NonFiniteError
from hpccomm.state import KeyState

from .helpers import COMM, RANK, SIZE, raise_everywhere, same_on_all_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.wide]

ALGORITHMS = hpccomm.sparse_algorithms()
#: small blocks so that the pipeline has several (and a ragged last one)
OPTIONS = {"rle_pipeline": {"block": 100, "window": 3}}
#: algorithms that switch a dense-enough result to a dense representation
SWITCHING = ("sparse_allgather", "sparse_rd", "sparse_split", "oktopk", "sparse_op",
             "rle_pipeline")


def rank_pairs(n, density, seed=0, rank=RANK, integers=True, span=None, same_indices=False):
    """This rank's unsorted (indices, values); ``span`` = (lo, hi) confines
    the indices; ``same_indices``: the index set is the same on every rank."""
    lo, hi = span or (0, n)
    k = int(round(density * (hi - lo)))
    rng_idx = np.random.default_rng([seed, 0 if same_indices else rank + 1, n, k])
    rng = np.random.default_rng([seed, rank + 1, n, k, 7])
    idx = lo + rng_idx.permutation(hi - lo)[:k]
    vals = rng.integers(-50, 51, size=k) if integers else rng.standard_normal(k)
    return idx.astype(np.int64), vals.astype(np.float32)


def reference(n, *args, **kwargs):
    """The float64 sum over all ranks of :func:`rank_pairs`."""
    total = np.zeros(n, dtype=np.float64)
    for r in range(SIZE):
        idx, vals = rank_pairs(n, *args, rank=r, **kwargs)
        np.add.at(total, idx, vals.astype(np.float64))
    return total


def same_sparse(sv):
    return same_on_all_ranks(sv.indices) and same_on_all_ranks(sv.values)


def run(alg, pairs, n, result="dense", stats=None, out=None, **options):
    opts = {**OPTIONS.get(alg, {}), **options}
    return hpccomm.sparse_allreduce((pairs[0], pairs[1], n), algorithm=alg, result=result,
                                    out=out, stats=stats, **opts)


# (n, density, span) -- empty vectors, n < P, nnz < P, dense, skewed
CASES = [
    (0, 0.0, None),
    (1, 1.0, None),
    (5, 0.4, None),
    (37, 1.0, None),
    (1000, 0.0, None),
    (1000, 0.003, None),        # nnz = 3 per rank: nnz < P at wide rank counts
    (1000, 0.05, None),
    (1000, 0.4, None),
    (1000, 0.5, (0, 40)),       # all mass in one small range (one owner / subtree)
    (4099, 0.02, None),
]


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_integer_inputs_sum_exactly(alg):
    got = []
    for n, density, span in CASES:
        pairs = rank_pairs(n, density, span=span)
        stats = hpccomm.CallStats()
        buf = np.full(n, np.nan, np.float32)      # every element must be written
        dense = run(alg, pairs, n, stats=stats, out=buf)
        sparse = run(alg, pairs, n, result="sparse")
        got.append((dense, sparse, stats, same_on_all_ranks(dense), same_sparse(sparse),
                    dense is buf))
    for (n, density, span), (dense, sparse, stats, same_d, same_s, into) in zip(CASES, got):
        ref = reference(n, density, span=span)
        assert into
        assert dense.dtype == np.float32 and dense.shape == (n,)
        np.testing.assert_array_equal(dense, ref.astype(np.float32), err_msg=f"{n} {density}")
        nz = np.flatnonzero(ref)
        assert isinstance(sparse, hpccomm.SparseVector) and sparse.n == n
        np.testing.assert_array_equal(sparse.indices, nz)
        np.testing.assert_array_equal(sparse.values, ref[nz].astype(np.float32))
        assert same_d and same_s, "ranks hold different results"
        if SIZE > 1 and ref.any():
            assert stats.bytes_sent > 0 and stats.bytes_recv > 0 and stats.t_comm > 0


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_float_inputs_within_reassociation_bound(alg):
    n, density = 3001, 0.1
    pairs = rank_pairs(n, density, seed=5, integers=False)
    dense = run(alg, pairs, n)
    same = same_on_all_ranks(dense)
    ref = reference(n, density, seed=5, integers=False)
    mag = np.zeros(n)
    for r in range(SIZE):
        idx, vals = rank_pairs(n, density, seed=5, rank=r, integers=False)
        np.add.at(mag, idx, np.abs(vals.astype(np.float64)))
    assert same
    assert np.all(np.abs(dense - ref) <= SIZE * np.finfo(np.float32).eps * mag)


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_empty_on_some_ranks_and_shared_index_sets(alg):
    n = 500
    empty = rank_pairs(n, 0.1 if RANK % 2 else 0.0)
    shared = rank_pairs(n, 0.2, seed=3, same_indices=True)
    r1 = run(alg, empty, n)
    r2 = run(alg, shared, n, result="sparse")
    same = same_on_all_ranks(r1) and same_sparse(r2)
    ref1 = np.zeros(n)
    for r in range(SIZE):
        idx, vals = rank_pairs(n, 0.1 if r % 2 else 0.0, rank=r)
        np.add.at(ref1, idx, vals)
    np.testing.assert_array_equal(r1, ref1.astype(np.float32))
    ref2 = reference(n, 0.2, seed=3, same_indices=True)
    np.testing.assert_array_equal(r2.to_dense(), ref2.astype(np.float32))
    assert same


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_fully_dense_input_is_correct_and_goes_dense(alg):
    n = 1000
    pairs = rank_pairs(n, 1.0, seed=4)
    stats = hpccomm.CallStats()
    dense = run(alg, pairs, n, stats=stats)
    same = same_on_all_ranks(dense)
    went = COMM.allgather(stats.extra.get("went_dense"))
    np.testing.assert_array_equal(dense, reference(n, 1.0, seed=4).astype(np.float32))
    assert same
    if alg in SWITCHING:
        assert went == [True] * SIZE, went
    if alg == "sparse_split" and SIZE > 1:
        # dense ranges both ways: no more than a dense reduce-scatter + allgather
        assert stats.bytes_sent <= 2 * 4 * n + 16 * SIZE


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_allreducer_dense_input_codec_none(alg):
    n = 2000
    rng = np.random.default_rng([9, RANK])
    x = np.zeros(n, np.float32)
    x[rng.permutation(n)[:150]] = rng.integers(-9, 10, size=150)
    xs = COMM.allgather(x)
    reducer = hpccomm.Allreducer(codec="none", algorithm=alg, **OPTIONS.get(alg, {}))
    res = reducer(x.reshape(40, 50), key="w")
    full = reducer(np.ones(n, np.float32) * (RANK + 1))
    mean = hpccomm.allreduce(x, algorithm=alg, op="mean")
    same = same_on_all_ranks(res) and same_on_all_ranks(full) and same_on_all_ranks(mean)
    last = reducer.stats.last
    total = np.sum(xs, axis=0, dtype=np.float64)
    assert res.shape == (40, 50)
    np.testing.assert_array_equal(res.reshape(-1), total.astype(np.float32))
    np.testing.assert_array_equal(full, np.full(n, SIZE * (SIZE + 1) / 2, np.float32))
    np.testing.assert_allclose(mean, (total / SIZE).astype(np.float32), rtol=1e-6)
    assert same
    assert last.extra["nnz"] == n
    if alg in SWITCHING:
        assert last.extra["went_dense"]


@pytest.mark.skipif("topk" not in hpccomm.available_codecs(), reason="codec topk not registered")
@pytest.mark.parametrize("alg", ALGORITHMS)
def test_allreducer_with_topk(alg):
    n, ratio = 1500, 0.05
    rng = np.random.default_rng([10, RANK])
    x = rng.integers(-100, 101, size=n).astype(np.float32)
    xs = COMM.allgather(x)
    reducer = hpccomm.Allreducer(codec="topk", algorithm=alg, ratio=ratio, exact=True,
                                 error_feedback=False, **OPTIONS.get(alg, {}))
    res = reducer(x)
    same = same_on_all_ranks(res)
    codec = hpccomm.get_codec("topk", ratio=ratio, exact=True)
    total = np.zeros(n, np.float64)
    for r, xr in enumerate(xs):
        idx, vals = codec.sparsify(xr, EncodeContext(seed=0, rank=r, step=0, shape=(n,)))
        total[idx] += vals
    np.testing.assert_array_equal(res, total.astype(np.float32))
    assert same


@register_codec
class KeepLarge(Codec):
    """A lossy test codec without ``sparsify``: keeps entries with ``|x| >= 3``
    (dense packet: header + float32 values, zeros where dropped)."""

    name = "test-keep-large"
    codec_id = 245
    biased = True

    def wire_size(self, n):
        return HEADER_SIZE + 4 * n

    def _encode(self, x, ctx):
        packet = self.new_packet(self.wire_size(x.size), x.size)
        packet[HEADER_SIZE:].view(np.float32)[:] = np.where(np.abs(x) >= 3, x, 0)
        return packet

    def _decode_into(self, packet, header, out, add):
        values = packet[HEADER_SIZE:].view(np.float32)
        if add:
            out += values
        else:
            out[:] = values


def keep_large(v):
    return np.where(np.abs(v) >= 3, v, 0).astype(np.float32)


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_error_feedback_with_a_lossy_codec(alg):
    n = 700
    steps = [np.random.default_rng([11, RANK, s]).integers(-4, 5, size=n).astype(np.float32)
             for s in range(3)]
    reducer = hpccomm.Allreducer(codec="test-keep-large", algorithm=alg,
                                 **OPTIONS.get(alg, {}))
    results = [reducer(x, key="g") for x in steps]
    same = all(same_on_all_ranks(r) for r in results)
    residual = reducer._states["g"].residuals["worker"].copy()
    # simulate every rank: v = x + e; sent = keep_large(v); e = v - sent
    expect = [np.zeros(n, np.float64) for _ in steps]
    for r in range(SIZE):
        e = np.zeros(n, np.float32)
        for s in range(len(steps)):
            v = np.random.default_rng([11, r, s]).integers(-4, 5, size=n).astype(np.float32) + e
            sent = keep_large(v)
            expect[s] += sent
            e = v - sent
            if r == RANK:
                own_residual = e
    assert reducer.memory.enabled
    for got, ref in zip(results, expect):
        np.testing.assert_array_equal(got, ref.astype(np.float32))
    np.testing.assert_array_equal(residual, own_residual)
    assert same


def test_kylix_reuses_its_configuration_while_index_sets_repeat():
    n = 3000
    idx, _ = rank_pairs(n, 0.05, seed=12)
    state = KeyState()
    calls = []
    for step in range(4):
        vals = np.random.default_rng([12, RANK, step]).integers(-9, 10, idx.size)
        my_idx = idx
        if step == 3 and RANK == 0:       # one rank's pattern changes
            my_idx = np.setdiff1d(np.arange(n), idx)[:idx.size]
        stats = hpccomm.CallStats()
        res = hpccomm.sparse_allreduce((my_idx, vals.astype(np.float32), n), algorithm="kylix",
                                       state=state, stats=stats, hash_indices=True)
        calls.append((my_idx, vals, res, stats, same_on_all_ranks(res)))
    inputs = COMM.allgather([(c[0], c[1]) for c in calls])
    cached = COMM.allgather([c[3].extra["config_cached"] for c in calls])
    for step, (_, _, res, stats, same) in enumerate(calls):
        ref = np.zeros(n)
        for r in range(SIZE):
            i, v = inputs[r][step]
            np.add.at(ref, i, v)
        np.testing.assert_array_equal(res, ref.astype(np.float32))
        assert same
    # every rank decides alike: fresh, cached, cached, and fresh again after one rank changed
    assert all(c == [False, True, True, False] for c in cached), cached
    if SIZE > 1:
        assert calls[1][3].bytes_sent < calls[0][3].bytes_sent


def test_kylix_every_factorization_with_and_without_hashing():
    n = 2000
    pairs = rank_pairs(n, 0.5, seed=13, span=(100, 260))   # one hot range
    out = []
    for degrees in factorizations(SIZE):
        for hashed in (False, True):
            stats = hpccomm.CallStats()
            res = run("kylix", pairs, n, stats=stats, degrees=degrees, hash_indices=hashed)
            out.append((degrees, res, stats.extra["degrees"], same_on_all_ranks(res)))
    ref = reference(n, 0.5, seed=13, span=(100, 260)).astype(np.float32)
    for degrees, res, used, same in out:
        np.testing.assert_array_equal(res, ref, err_msg=str(degrees))
        assert tuple(used) == tuple(degrees) and same


def test_oktopk_balances_skewed_inputs():
    n = 10000
    pairs = rank_pairs(n, 0.3, seed=16, span=(0, 1000))   # everything in range 0 of sparse_split
    loads = {}
    for alg in ("sparse_split", "oktopk"):
        stats = hpccomm.CallStats()
        res = run(alg, pairs, n, stats=stats)
        loads[alg] = (res, COMM.allgather(stats.extra["owned_nnz"]), same_on_all_ranks(res))
    ref = reference(n, 0.3, seed=16, span=(0, 1000)).astype(np.float32)
    union = np.count_nonzero(ref)
    for alg, (res, owned, same) in loads.items():
        np.testing.assert_array_equal(res, ref)
        assert same and sum(owned) >= union
    if SIZE > 1:
        assert loads["sparse_split"][1][0] >= union - 1       # one owner takes all
        assert max(loads["oktopk"][1]) <= 2 * union // SIZE + 2, loads["oktopk"][1]


def test_rle_pipeline_many_small_blocks():
    n = 1003
    rng = np.random.default_rng([14, RANK])
    mask = np.zeros(n, bool)
    for start in rng.integers(0, n, size=12):
        mask[start:start + 20] = True
    idx = np.flatnonzero(mask)
    vals = rng.integers(1, 5, size=idx.size).astype(np.float32)
    stats = hpccomm.CallStats()
    res = hpccomm.sparse_allreduce((idx, vals, n), algorithm="rle_pipeline", block=7, window=2,
                                   stats=stats)
    sv = hpccomm.sparse_allreduce((idx, vals, n), algorithm="rle_pipeline", block=7,
                                  result="sparse")
    same = same_on_all_ranks(res) and same_sparse(sv)
    everything = COMM.allgather((idx, vals))
    ref = np.zeros(n, np.float32)
    for i, v in everything:
        ref[i] += v
    np.testing.assert_array_equal(res, ref)
    np.testing.assert_array_equal(sv.to_dense(), ref)
    assert stats.extra["blocks"] == -(-n // 7) and same


def test_int64_indices_for_huge_vectors():
    n = 2 ** 31 + 5
    rng = np.random.default_rng([15, RANK])
    idx = np.concatenate([rng.integers(0, n, size=40), [n - 1, 2 ** 31 + 1]])
    vals = rng.integers(-5, 6, size=idx.size).astype(np.float32)
    everything = COMM.allgather((idx, vals))
    results = {}
    for alg in ALGORITHMS:
        if alg == "rle_pipeline":      # one message per block of index space: not for huge n
            continue
        sv = hpccomm.sparse_allreduce((idx, vals, n), algorithm=alg, result="sparse")
        results[alg] = (sv, same_sparse(sv))
    all_i = np.concatenate([i for i, _ in everything])
    all_v = np.concatenate([v for _, v in everything])
    ref = hpccomm.SparseVector(all_i, all_v, n)
    keep = ref.values != 0
    for alg, (sv, same) in results.items():
        assert sv.indices.dtype == np.int64, alg
        np.testing.assert_array_equal(sv.indices, ref.indices[keep], err_msg=alg)
        np.testing.assert_array_equal(sv.values, ref.values[keep], err_msg=alg)
        assert same


def expect_everywhere(fn, exc_type, fragment):
    (name, message), agreed = raise_everywhere(fn)
    assert name == exc_type.__name__, (name, message)
    assert fragment in message, message
    assert agreed, "ranks raised different errors"


@pytest.mark.parametrize("alg", ["sparse_split", "kylix", "sparse_op"])
def test_bad_input_raises_the_same_error_everywhere(alg):
    n, last = 10, SIZE - 1
    good = ([1, 4], [1.0, 2.0], n)
    expect_everywhere(
        lambda: hpccomm.sparse_allreduce(([1, n + 2], [1.0, 2.0], n) if RANK == last else good,
                                         algorithm=alg),
        ValueError, f"rank {last}: SparseVector: index {n + 2} at position 1 is out of range "
                    f"for n={n}")
    expect_everywhere(
        lambda: hpccomm.sparse_allreduce(([-3], [1.0], n) if RANK == 0 else good, algorithm=alg),
        ValueError, "rank 0: SparseVector: index -3 at position 0 is negative")
    expect_everywhere(
        lambda: hpccomm.sparse_allreduce(([2], [np.nan], n) if RANK == last else good,
                                         algorithm=alg),
        NonFiniteError, f"rank {last}: SparseVector: values hold 1 NaN/Inf")
    expect_everywhere(lambda: hpccomm.sparse_allreduce(good, algorithm=alg, result="csr"),
                      ValueError, "result must be one of")
    expect_everywhere(lambda: hpccomm.sparse_allreduce(good, algorithm=alg,
                                                       out=np.empty(n + (RANK == 0), np.float32)),
                      ValueError, "rank 0: out must be a writeable contiguous float32 array")
    expect_everywhere(lambda: hpccomm.sparse_allreduce(good, algorithm=alg, bogus=1),
                      TypeError, f"unknown option 'bogus' for algorithm '{alg}'")


@pytest.mark.mpi(min_size=2)
def test_mismatched_lengths_raise_everywhere():
    sv = hpccomm.SparseVector([1], [1.0], 10 + (RANK == 1))
    expect_everywhere(lambda: hpccomm.sparse_allreduce(sv), ConsistencyError, "n=11")


def test_configuration_errors_raise_everywhere():
    good = ([1], [1.0], 4)
    expect_everywhere(lambda: hpccomm.sparse_allreduce(good, algorithm="twoshot"), ValueError,
                      "algorithm 'twoshot' does not take sparse input")
    expect_everywhere(lambda: hpccomm.sparse_allreduce(good, algorithm="kylix",
                                                       degrees=(SIZE + 1,)),
                      ValueError, f"product is the number of ranks, {SIZE}")
    expect_everywhere(lambda: hpccomm.sparse_allreduce([1, 2]), TypeError,
                      "takes a SparseVector or an (indices, values, n) tuple")
