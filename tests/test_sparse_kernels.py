"""Sparse kernels, streams, records and SparseVector against numpy references
(no MPI): random inputs, empty inputs, and sizes that are not multiples of 8,
32 or a rank count."""
import math

import numpy as np
import pytest

import hpccomm
from hpccomm.collectives.sparse.kylix import (choose_degrees, factorizations, hash_multiplier,
                                      union_with_maps)
from hpccomm.collectives.sparse.rle_pipeline import encode_block, merge_blocks
from hpccomm.collectives.sparse.mpi_op import RecordLayout
from hpccomm.collectives.transport import binomial_children
from hpccomm.collectives.sparse.base import Part, goes_dense, index_dtype, merge_parts
from hpccomm.errors import NonFiniteError, PacketError
from hpccomm.kernels import merge as K

SIZES = [0, 1, 7, 31, 33, 257, 1000]


def random_pairs(rng, n, density, dtype=np.int32, integers=True, lo=0):
    k = int(round(density * n))
    idx = np.sort(rng.choice(n, size=k, replace=False)).astype(dtype) + dtype(lo)
    if integers:
        vals = rng.integers(-20, 21, size=k).astype(np.float32)
    else:
        vals = rng.standard_normal(k).astype(np.float32)
    return idx, vals


def dense_of(idx, vals, n, lo=0):
    d = np.zeros(n, dtype=np.float32)
    d[idx - lo] = vals
    return d


def clustered_pairs(rng, n, runs, dtype=np.int32):
    """Pairs in a few contiguous runs (what run-length coding is for)."""
    mask = np.zeros(n, dtype=bool)
    for _ in range(runs):
        if n:
            start = int(rng.integers(0, n))
            mask[start:start + int(rng.integers(1, 9))] = True
    idx = np.flatnonzero(mask).astype(dtype)
    return idx, rng.integers(1, 9, size=idx.size).astype(np.float32)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("n", SIZES)
def test_merge_sum_matches_union_and_dense_sum(n, dtype):
    rng = np.random.default_rng(n)
    for da, db in [(0, 0), (0.1, 0.5), (0.5, 0.5), (1, 0.3), (1, 1)]:
        ia, va = random_pairs(rng, n, da, dtype, integers=False)
        ib, vb = random_pairs(rng, n, db, dtype, integers=False)
        ic, vc = K.merge_sum(ia, va, ib, vb)
        assert ic.dtype == dtype and vc.dtype == np.float32
        np.testing.assert_array_equal(ic, np.union1d(ia, ib))
        # a + b with a the left operand, bit for bit
        np.testing.assert_array_equal(K.densify(ic, vc, 0, n),
                                      dense_of(ia, va, n) + dense_of(ib, vb, n))
        jc, wc = K.merge_sum(ib, vb, ia, va)
        np.testing.assert_array_equal(ic, jc)
        np.testing.assert_array_equal(vc.view(np.uint32), wc.view(np.uint32))  # commutative


@pytest.mark.parametrize("n", SIZES)
def test_coalesce_sums_duplicates_left_to_right(n):
    rng = np.random.default_rng(100 + n)
    idx = np.sort(rng.integers(0, max(n, 1), size=3 * n)).astype(np.int64)
    vals = rng.standard_normal(idx.size).astype(np.float32)
    ci, cv = K.coalesce_sorted(idx, vals)
    np.testing.assert_array_equal(ci, np.unique(idx))
    expect = {}
    for i, v in zip(idx.tolist(), vals):
        expect[i] = expect[i] + v if i in expect else v  # float32 arithmetic, in order
    np.testing.assert_array_equal(cv, np.array([expect[i] for i in ci.tolist()], np.float32))


@pytest.mark.parametrize("n", SIZES)
def test_scatter_add_densify_nonzeros(n):
    rng = np.random.default_rng(200 + n)
    idx = rng.integers(0, max(n, 1), size=2 * n).astype(np.int32) if n else np.zeros(0, np.int32)
    vals = rng.standard_normal(idx.size).astype(np.float32)
    out = rng.standard_normal(n).astype(np.float32)
    ref = out.copy()
    np.add.at(ref, idx, vals)
    K.scatter_add(out, idx + 5, vals, 5)
    np.testing.assert_array_equal(out, ref)
    ui, uv = random_pairs(rng, n, 0.3, lo=9)
    np.testing.assert_array_equal(K.densify(ui, uv, 9, 9 + n), dense_of(ui, uv, n, lo=9))
    into = np.full(n, 3, np.float32)
    K.scatter_set(into, ui, uv, 9)
    expect = np.full(n, 3, np.float32)
    expect[ui - 9] = uv
    np.testing.assert_array_equal(into, expect)
    d = dense_of(ui, uv, n, lo=9)
    nz_i, nz_v = K.nonzeros(d, 3, np.zeros(1, np.int64))
    assert nz_i.dtype == np.int64
    np.testing.assert_array_equal(nz_i, np.flatnonzero(d) + 3)
    np.testing.assert_array_equal(nz_v, d[d != 0])
    keep_i, keep_v = K.drop_zeros(ui, uv)
    np.testing.assert_array_equal(keep_i, ui[uv != 0])
    np.testing.assert_array_equal(keep_v, uv[uv != 0])


@pytest.mark.parametrize("m", SIZES)
def test_rle_round_trips_and_merges_without_decoding(m):
    rng = np.random.default_rng(300 + m)
    for trial in range(20):
        lo = int(rng.integers(0, 50))
        if trial % 2:
            ia, va = clustered_pairs(rng, m, 4)
            ib, vb = clustered_pairs(rng, m, 4)
        else:
            ia, va = random_pairs(rng, m, rng.uniform(0, 1))
            ib, vb = random_pairs(rng, m, rng.uniform(0, 1))
        ia, ib = ia + lo, ib + lo
        wa, wb = K.rle_encode_pairs(ia, va, lo, m), K.rle_encode_pairs(ib, vb, lo, m)
        da, db = dense_of(ia, va, m, lo), dense_of(ib, vb, m, lo)
        np.testing.assert_array_equal(K.rle_decode(wa, m), da)
        into = np.full(m, 5, np.float32)
        K.rle_decode_into(wa, into)
        np.testing.assert_array_equal(into, da)
        # size: 1 + 2 segments + values; the segments are the maximal runs
        present = np.concatenate([[0], np.isin(np.arange(m) + lo, ia), [0]]).astype(int)
        runs = int(np.sum(np.diff(present) == 1))
        assert wa.size == 1 + 2 * runs + ia.size and wa[0] == runs
        wc = K.rle_merge(wa, wb)
        ic, vc = K.merge_sum(ia, va, ib, vb)
        np.testing.assert_array_equal(wc, K.rle_encode_pairs(ic, vc, lo, m))
        np.testing.assert_array_equal(K.rle_decode(wc, m), da + db)
        pi, pv = K.rle_to_pairs(wc, lo, m, np.zeros(1, np.int32))
        np.testing.assert_array_equal(pi, ic)
        np.testing.assert_array_equal(pv, vc)
        acc = da.copy()
        K.rle_add_into(wb, acc)
        np.testing.assert_array_equal(acc, da + db)
        dense_words = K.rle_dense_words(da)
        assert dense_words[0] == K.RLE_DENSE and dense_words.size == 1 + m
        np.testing.assert_array_equal(K.rle_decode(dense_words, m), da)
        acc = db.copy()
        K.rle_add_into(dense_words, acc)
        np.testing.assert_array_equal(acc, db + da)
        di, dv = K.rle_to_pairs(dense_words, lo, m, np.zeros(1, np.int32))
        np.testing.assert_array_equal(di, np.flatnonzero(da) + lo)
        np.testing.assert_array_equal(dv, da[da != 0])


@pytest.mark.parametrize("m", [1, 5, 64, 257])
def test_rle_blocks_fall_back_to_dense_and_merge_in_every_form(m):
    rng = np.random.default_rng(400 + m)
    for da, db in [(0.02, 0.02), (1.0, 0.1), (0.1, 1.0), (1.0, 1.0), (0.0, 0.6)]:
        ia, va = random_pairs(rng, m, da)
        ib, vb = random_pairs(rng, m, db)
        wa, wb = encode_block(ia, va, 0, m), encode_block(ib, vb, 0, m)
        for w, i in ((wa, ia), (wb, ib)):
            rle_size = K.rle_encode_pairs(i, np.ones(i.size, np.float32), 0, m).size
            assert (w[0] == K.RLE_DENSE) == (rle_size >= 1 + m)
            assert w.size <= 1 + m
        merged = merge_blocks(wa, wb, m)
        assert merged.size <= 1 + m
        np.testing.assert_array_equal(K.rle_decode(merged, m),
                                      dense_of(ia, va, m) + dense_of(ib, vb, m))


def make_record(layout, idx, vals):
    rec = np.zeros(layout.nbytes, dtype=np.uint8)
    layout.fill(rec, idx, vals)
    return rec


def record_merge(layout, a, b):
    b = b.copy()
    K.record_merge(*layout.views(a), *layout.views(b), layout.cap)
    return b


@pytest.mark.parametrize("n", [1, 10, 33, 1000])
def test_record_merge_is_a_commutative_sum_that_overflows_to_dense(n):
    rng = np.random.default_rng(500 + n)
    idt = index_dtype(n)
    for da, db in [(0, 0), (0.05, 0.1), (0.3, 0.3), (0.7, 0.1), (1, 1)]:
        ia, va = random_pairs(rng, n, da, integers=False)
        ib, vb = random_pairs(rng, n, db, integers=False)
        for total in (ia.size + ib.size, 3 * n):   # exact capacity, and dense-capable
            layout = RecordLayout(n, total, idt)
            assert layout.nbytes % 8 == 0
            assert layout.dense_capable == (total * (idt.itemsize + 4) >= 4 * n)
            a, b = make_record(layout, ia, va), make_record(layout, ib, vb)
            ab, ba = record_merge(layout, a, b), record_merge(layout, b, a)
            np.testing.assert_array_equal(ab, ba)  # bitwise commutative
            part = layout.part(ab)
            union = np.union1d(ia, ib).size
            assert part.is_dense == (union > layout.cap)
            got = np.zeros(n, np.float32)
            part.write_into(got)
            np.testing.assert_array_equal(got, dense_of(ia, va, n) + dense_of(ib, vb, n))


def test_binomial_tree_has_p_minus_1_edges():
    for P in range(1, 20):
        assert sum(binomial_children(r, P) for r in range(P)) == P - 1


@pytest.mark.parametrize("n", [1, 2, 3, 10, 97, 1000, 1024, 4096])
def test_affine_hash_is_a_bijection(n):
    a = hash_multiplier(n)
    assert math.gcd(a, n) == 1 and 0 <= a < max(n, 2)
    h = K.affine_map(np.arange(n, dtype=np.int64), a, 0, n)
    np.testing.assert_array_equal(np.sort(h), np.arange(n))
    back = K.affine_map(h, pow(a, -1, n), 0, n)
    np.testing.assert_array_equal(back, np.arange(n))


@pytest.mark.parametrize("n", [2 ** 31 + 11, 2 ** 32 + 15, 2 ** 45 + 3, 2 ** 62 + 1])
def test_affine_hash_large_n_matches_python_integers(n):
    rng = np.random.default_rng(7)
    idx = rng.integers(0, n, size=500, dtype=np.int64)
    a = hash_multiplier(n)
    got = K.affine_map(idx, a, 12345, n)
    np.testing.assert_array_equal(got, np.array([(a * int(i) + 12345) % n for i in idx]))


def test_hash_spreads_a_hot_range():
    n, P = 1 << 20, 8
    hot = np.arange(1000, 1000 + 4096, dtype=np.int64)    # one hot range
    h = K.affine_map(hot, hash_multiplier(n), 0, n)
    counts = np.bincount(h * P // n, minlength=P)
    assert counts.max() - counts.min() <= 4096 // P // 4


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_kylix_union_with_maps(k):
    rng = np.random.default_rng(k)
    for n in (0, 5, 33, 1000):
        pieces = [random_pairs(rng, n, rng.uniform(0, 1))[0] for _ in range(k)]
        union, maps = union_with_maps(pieces)
        np.testing.assert_array_equal(union, np.unique(np.concatenate(pieces)))
        assert union.dtype == np.int32 and len(maps) == k
        for piece, m in zip(pieces, maps):
            np.testing.assert_array_equal(union[m], piece)


def test_kylix_degree_choice():
    for P in range(1, 49):
        facts = factorizations(P)
        assert all(math.prod(f) == P and list(f) == sorted(f, reverse=True) for f in facts)
        assert len(set(facts)) == len(facts)
    assert factorizations(1) == [()]
    assert factorizations(7) == [(7,)]
    assert set(factorizations(12)) == {(12,), (6, 2), (4, 3), (3, 2, 2)}
    assert choose_degrees(7, 10 ** 6, 10 ** 5) == (7,)
    assert choose_degrees(16, 10 ** 7, 16 * 10 ** 7) == (2, 2, 2, 2)   # dense: binary
    assert choose_degrees(16, 10 ** 9, 16 * 10 ** 6) == (16,)        # large and sparse: one layer


@pytest.mark.parametrize("idt", [np.dtype(np.int32), np.dtype(np.int64)])
def test_part_payload_round_trip_and_switch(idt):
    rng = np.random.default_rng(8)
    lo, hi = 100, 100 + 301
    for density in (0, 0.1, 0.3, 0.6, 1):
        idx, vals = random_pairs(rng, hi - lo, density, idt.type, lo=lo)
        part = Part.from_pairs(lo, hi, idt, idx, vals)
        assert part.is_dense == goes_dense(idx.size, hi - lo, idt.itemsize)
        payload = part.payload()
        assert payload.size == part.wire_bytes <= 4 * (hi - lo)
        back = Part.from_payload(payload.copy(), lo, hi, idt)
        assert back.is_dense == part.is_dense
        out = np.full(hi + 5, 7, np.float32)
        back.write_into(out)
        np.testing.assert_array_equal(out[lo:hi], dense_of(idx, vals, hi - lo, lo))
        assert (out[:lo] == 7).all() and (out[hi:] == 7).all()
    with pytest.raises(PacketError, match="neither dense"):
        Part.from_payload(np.zeros(idt.itemsize + 3, np.uint8), lo, hi, idt)


def test_merge_parts_sums_in_the_order_given():
    rng = np.random.default_rng(9)
    n, idt = 200, np.dtype(np.int32)
    for density in (0.01, 0.1, 0.4):
        pairs = [random_pairs(rng, n, density, integers=False) for _ in range(5)]
        parts = [Part.from_pairs(0, n, idt, i, v) for i, v in pairs]
        got = np.zeros(n, np.float32)
        merge_parts(parts, 0, n, idt).write_into(got)
        ref = np.zeros(n, np.float32)
        for i, v in pairs:
            ref[i] += v
        # sequential float32 sums in order; zero + x == x, so both forms agree
        np.testing.assert_array_equal(got, ref)


class TestSparseVector:
    def test_sorts_and_sums_duplicates(self):
        sv = hpccomm.SparseVector([7, 2, 7, 0, 2], [1.0, 2.0, 0.5, 3.0, -2.0], 10)
        np.testing.assert_array_equal(sv.indices, [0, 2, 7])
        np.testing.assert_array_equal(sv.values, [3.0, 0.0, 1.5])   # explicit zero kept
        assert sv.indices.dtype == np.int32 and sv.values.dtype == np.float32 and sv.nnz == 3
        np.testing.assert_array_equal(sv.to_dense(), [3, 0, 0, 0, 0, 0, 0, 1.5, 0, 0])

    def test_index_dtype_follows_n(self):
        assert hpccomm.SparseVector([5], [1.0], 2 ** 31 - 1).indices.dtype == np.int32
        assert hpccomm.SparseVector([2 ** 31 + 1], [1.0], 2 ** 31 + 2).indices.dtype == np.int64
        assert hpccomm.SparseVector(np.array([], np.uint64), [], 0).nnz == 0

    def test_copies_its_input(self):
        idx, vals = np.array([1, 3]), np.array([1.0, 2.0], np.float32)
        sv = hpccomm.SparseVector(idx, vals, 4)
        vals[0] = 99
        assert sv.values[0] == 1.0

    def test_from_dense(self):
        x = np.array([0, 1.5, 0, -2, 0], np.float32)
        sv = hpccomm.SparseVector.from_dense(x)
        np.testing.assert_array_equal(sv.indices, [1, 3])
        np.testing.assert_array_equal(sv.to_dense(), x)

    @pytest.mark.parametrize("args, exc, match", [
        (([0, 10], [1, 2], 10), ValueError, "index 10 at position 1 is out of range for n=10"),
        (([3, -1], [1, 2], 10), ValueError, "index -1 at position 1 is negative"),
        (([1, 2], [1], 10), ValueError, "2 indices but 1 values"),
        (([1.0], [1], 10), TypeError, "indices must be integers"),
        (([1], ["a"], 10), TypeError, "values must be real"),
        (([1], [np.nan], 10), NonFiniteError, "1 NaN/Inf"),
        (([1], [1e39], 10), NonFiniteError, "NaN/Inf"),     # overflows float32
        (([1], [1], -1), ValueError, "n must be in"),
        (([1], [1], 2.0), TypeError, "n must be an integer"),
        (([[1]], [[1]], 4), ValueError, "1-D"),
        ((np.array([2 ** 63], np.uint64), [1.0], 2 ** 63 - 1), ValueError, "out of range"),
    ])
    def test_bad_input(self, args, exc, match):
        with pytest.raises(exc, match=match):
            hpccomm.SparseVector(*args)

    def test_nonfinite_propagate(self):
        sv = hpccomm.SparseVector([1], [np.inf], 3, nonfinite="propagate")
        assert np.isinf(sv.values[0])

    def test_validate_catches_mutation(self):
        sv = hpccomm.SparseVector([1, 2], [1.0, 2.0], 3)
        sv.indices[1] = 5
        with pytest.raises(ValueError, match="out of range"):
            sv.validate()
        sv.indices[:] = [2, 1]
        with pytest.raises(ValueError, match="not strictly increasing"):
            sv.validate()


# ---------------------------------------------------------------------------
# checks of what arrives from the wire (the kernels above check nothing)
# ---------------------------------------------------------------------------
def first_unordered_reference(idx, lo, hi):
    prev = lo - 1
    for t, i in enumerate(int(v) for v in idx):
        if i <= prev or i >= hi:
            return t
        prev = i
    return -1


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("n", SIZES)
def test_first_unordered_finds_the_first_bad_index(n, dtype):
    rng = np.random.default_rng(600 + n)
    lo = int(rng.integers(0, 9))
    for trial in range(30):
        idx, _ = random_pairs(rng, n, rng.uniform(0, 1), dtype=dtype, lo=lo)
        assert K.first_unordered(idx, lo, lo + n) == -1
        if not idx.size:
            continue
        bad = idx.copy()
        t = int(rng.integers(0, bad.size))
        bad[t] = [lo - 1, lo + n, bad[t - 1] if t else lo - 1,
                  bad[t - 1] - 1 if t else lo + n + 5][trial % 4]
        assert K.first_unordered(bad, lo, lo + n) == first_unordered_reference(bad, lo, lo + n)
        assert K.first_unordered(bad, lo, lo + n) <= t


def rle_valid_reference(words, m):
    """Walk the block as rle_decode_into would, in Python, with every read checked."""
    words = [int(w) for w in words]
    if not words:
        return False
    if words[0] == int(K.RLE_DENSE):
        return len(words) == 1 + m
    w, pos = 1, 0
    for _ in range(words[0]):
        if w + 2 > len(words):
            return False
        pos += words[w]
        run = words[w + 1]
        w += 2
        if pos + run > m or w + run > len(words):
            return False
        w += run
        pos += run
    return w == len(words)


@pytest.mark.parametrize("m", [1, 5, 64, 257])
def test_rle_valid_takes_every_block_and_refuses_broken_ones(m):
    rng = np.random.default_rng(700 + m)
    for trial in range(40):
        i, v = (clustered_pairs(rng, m, 3) if trial % 2 else
                random_pairs(rng, m, rng.uniform(0, 1)))
        for words in (K.rle_encode_pairs(i, v, 0, m), encode_block(i, v, 0, m),
                      K.rle_dense_words(dense_of(i, v, m))):
            assert K.rle_valid(words, m) and rle_valid_reference(words, m)
            broken = [words[:-1], np.append(words, np.uint32(0)), words.copy(), words.copy()]
            broken[2][0] = np.uint32(words[0] + 1) if words[0] != K.RLE_DENSE else 0
            if words.size > 2 and words[0] != K.RLE_DENSE:
                broken[3][1] = np.uint32(m)            # the first run starts past the block
            for b in broken:
                assert K.rle_valid(b, m) == rle_valid_reference(b, m)
            assert not K.rle_valid(broken[0], m) and not K.rle_valid(broken[1], m)


def test_a_payload_with_bad_indices_is_a_packet_error():
    idt = np.dtype(np.int32)
    good = Part.from_pairs(10, 110, idt, np.array([12, 50, 99], idt),
                           np.ones(3, np.float32)).payload()
    assert Part.from_payload(good, 10, 110, idt).nnz == 3
    for bad_idx in ([9, 50, 99], [12, 50, 110], [12, 12, 99], [50, 12, 99]):
        bad = good.copy()
        bad[:12] = np.array(bad_idx, idt).view(np.uint8)
        with pytest.raises(PacketError, match="not increasing inside"):
            Part.from_payload(bad, 10, 110, idt)


def test_a_record_with_a_bad_header_or_indices_is_a_packet_error():
    n, idt = 100, index_dtype(100)
    layout = RecordLayout(n, 2, idt)          # full: a count past it reads only valid indices
    rec = make_record(layout, np.array([3, 7], idt), np.ones(2, np.float32))
    assert layout.part(rec).nnz == 2
    for change in ("count", "flag", "order"):
        bad = rec.copy()
        hdr, idx, _, _ = layout.views(bad)
        if change == "count":
            hdr[0] = layout.cap + 1
        elif change == "flag":
            hdr[1] = 1                    # dense, in a record that cannot be
        else:
            idx[:2] = [7, 3]
        with pytest.raises(PacketError, match="sparse_op"):
            layout.part(bad)


@pytest.mark.parametrize("n", [1, 7, 1000, 25_601])
@pytest.mark.parametrize("zeros", ["a seventh", "all but a tenth", "half", "all"])
def test_kth_largest_is_the_order_statistic(n, zeros):
    """Against a full sort, every k -- around the count of non-zero values
    too, where the mostly-zero magnitudes are selected from their non-zero
    values -- with ties, zeros and NaN (which counts as the largest value);
    the input is left as it was."""
    from hpccomm.kernels import sparsify as S

    rng = np.random.default_rng(n)
    a = np.abs(rng.standard_normal(n)).astype(np.float32)
    a[rng.choice(n, n // 3, replace=False)] = np.float32(0.5)     # ties
    zero = {"a seventh": n // 7, "all but a tenth": n - n // 10, "half": n - n // 2,
            "all": n}[zeros]
    a[rng.permutation(n)[:zero]] = 0.0
    if n > 1 and np.count_nonzero(a):
        a[np.flatnonzero(a)[0]] = np.nan
    before = a.copy()
    desc = np.sort(a)[::-1]
    desc = np.concatenate([desc[np.isnan(desc)], desc[~np.isnan(desc)]])
    c = np.count_nonzero(a)
    for k in sorted(k for k in {1, 2, n // 2, n - 1, n, c - 1, c, c + 1} if 1 <= k <= n):
        got = S.kth_largest(a, k)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, desc[k - 1], err_msg=f"k={k}")
    np.testing.assert_array_equal(a, before)


def _keep_largest_reference(idx, vals, k):
    """The k entries of largest |vals|, ties to the lower positions, in order:
    a stable sort by descending magnitude."""
    order = np.argsort(-np.abs(vals).astype(np.float64), kind="stable")[:max(k, 0)]
    keep = np.sort(order)
    return idx[keep], vals[keep]


@pytest.mark.parametrize("m", [1, 2, 7, 64, 1000, 65_537, 224_001])
def test_keep_largest_against_a_stable_sort(m):
    """Every cut of random magnitudes with many ties (equal values of both
    signs, values that share their high 16 bits, zeros, infinities, the
    smallest subnormal) against a stable sort; the result stays in index
    order, and the inputs are left as they were."""
    from hpccomm.kernels import sparsify as S

    rng = np.random.default_rng(m)
    vals = rng.standard_normal(m).astype(np.float32)
    pick = rng.random(m)
    vals[pick < 0.2] = np.float32(1.5) * rng.choice([-1, 1], size=int((pick < 0.2).sum()))
    near = (pick >= 0.2) & (pick < 0.3)          # the same high 16 bits as 1.5
    vals[near] = (np.float32(1.5).view(np.uint32) + rng.integers(1, 1 << 16, int(near.sum()),
                                                                 dtype=np.uint32)).view(np.float32)
    vals[(pick >= 0.3) & (pick < 0.32)] = 0.0
    vals[(pick >= 0.32) & (pick < 0.33)] = -np.inf
    vals[(pick >= 0.33) & (pick < 0.34)] = np.float32(1e-45)
    idx = np.sort(rng.choice(4 * m, m, replace=False)).astype(np.int64)
    before = (idx.copy(), vals.copy())
    for k in sorted({0, 1, 2, m // 3, m // 2, m - 1, m, m + 1}):
        got = S.keep_largest(idx, vals, k)
        want = _keep_largest_reference(idx, vals, k)
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"k={k}")
        np.testing.assert_array_equal(got[1].view(np.uint32), want[1].view(np.uint32))
    np.testing.assert_array_equal(idx, before[0])
    np.testing.assert_array_equal(vals, before[1])


def test_keep_largest_with_nan_keeps_numpys_answer():
    """A NaN among the values: the cut counts it as the largest (as
    ``np.partition``) and no comparison keeps it -- the answer of the numpy
    steps, which the radix cut hands the call to (a long input, where the
    radix cut would run)."""
    from hpccomm.kernels import sparsify as S

    vals = np.array([3.0, np.nan, -5.0, 1.0, 4.0, -2.0], np.float32)
    idx = np.arange(6, dtype=np.int32) * 3
    got_idx, got_vals = S.keep_largest(idx, vals, 3)
    np.testing.assert_array_equal(got_idx, [6, 12])
    np.testing.assert_array_equal(got_vals, [-5.0, 4.0])
    m = 2 * S.RADIX_MIN + 3
    vals = np.random.default_rng(5).standard_normal(m).astype(np.float32)
    vals[[7, m // 2]] = np.nan
    idx = np.arange(m, dtype=np.int64)
    k = m // 3
    got_idx, got_vals = S.keep_largest(idx, vals, k)
    mags = np.abs(vals)
    cut = np.sort(mags)[m - k]               # np.sort puts NaN last, as partition does
    keep = mags >= cut                       # no other value equals the cut here
    assert keep.sum() == k - 2               # the two NaN are not kept
    np.testing.assert_array_equal(got_idx, idx[keep])
    np.testing.assert_array_equal(got_vals, vals[keep])


def _special_floats(rng, n):
    """float32 with the values comparisons trip on: +-0, +-inf, NaN of both
    signs, the smallest subnormal of both signs, and exact copies of the
    bounds the tests compare against (0.5 and -0.75)."""
    a = rng.standard_normal(n).astype(np.float32)
    pick = rng.random(n)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 0.5, -0.75],
                        np.float32)
    a[pick < 0.3] = rng.choice(specials, int((pick < 0.3).sum()))
    bits = a.view(np.uint32)
    bits[(pick >= 0.3) & (pick < 0.33)] = 0x7FC00000              # NaN
    bits[(pick >= 0.33) & (pick < 0.36)] = 0xFFC00000             # NaN, sign bit set
    return a


def _bits_of(flags):
    """The uint64 whose bit j is flags[j] (64 of them)."""
    return int(np.packbits(flags[::-1].astype(np.uint8)).view(">u8")[0])


@pytest.mark.parametrize("bounds", [(-0.75, 0.5), (0.0, 0.0), (-np.inf, 0.5), (-0.75, np.inf),
                                    (-1e-45, 1e-45), (np.nan, 0.5)])
def test_outside_masks_against_numpy(bounds):
    """Bit j of ``outside_closed`` / ``outside_open`` of 64 elements from any
    (unaligned) start against numpy's comparisons, over +-0, infinities, NaN
    of both signs, subnormals and values equal to a bound."""
    from numba import njit
    from numba.core.errors import TypingError

    from hpccomm.kernels.masks import outside_closed, outside_open

    @njit(cache=False)
    def masks(a, lo, hi):
        out = np.empty((a.size - 63, 2), np.uint64)
        for s in range(a.size - 63):
            out[s, 0] = outside_closed(a, s, lo, hi)
            out[s, 1] = outside_open(a, s, lo, hi)
        return out

    a = _special_floats(np.random.default_rng(3), 64 + 70)
    lo, hi = np.float32(bounds[0]), np.float32(bounds[1])
    got = masks(a, lo, hi)
    for s in range(a.size - 63):
        q = a[s:s + 64]
        assert int(got[s, 0]) == _bits_of((q >= hi) | (q <= lo)), s
        assert int(got[s, 1]) == _bits_of((q > hi) | (q < lo)), s
    with pytest.raises(TypingError):          # a strided array is never read as contiguous
        masks(np.repeat(a, 2)[::2], lo, hi)


def test_lowest_set_bit_and_the_chunk_extremes():
    """``lowest_set_bit`` of random words (every bit position, the top one
    included) against Python; ``largest64`` / ``most_negative64`` are the
    largest / most negative of a chunk that holds a positive / negative value
    and no NaN of that sign, and some value of the other sign or zero when it
    holds none."""
    from numba import njit

    from hpccomm.kernels.masks import largest64, lowest_set_bit, most_negative64

    @njit(cache=False)
    def lowest(words):
        out = np.empty(words.size, np.int64)
        for i in range(words.size):
            out[i] = lowest_set_bit(words[i])
        return out

    @njit(cache=False)
    def extremes(a):
        out = np.empty((a.size - 63, 2), np.float32)
        for s in range(a.size - 63):
            out[s, 0] = largest64(a, s)
            out[s, 1] = most_negative64(a, s)
        return out

    rng = np.random.default_rng(4)
    words = rng.integers(1, 1 << 63, 500, dtype=np.uint64) << rng.integers(0, 64, 500).astype(
        np.uint64)
    words = np.concatenate([words[words != 0], np.uint64(1) << np.arange(64, dtype=np.uint64)])
    want = [(int(w) & -int(w)).bit_length() - 1 for w in words]
    np.testing.assert_array_equal(lowest(words), want)

    a = _special_floats(rng, 64 + 400)
    bits = a.view(np.uint32)
    for s in range(0, 400, 5):                       # chunks without NaN
        bits[s + 7:s + 64][np.isnan(a[s + 7:s + 64])] = 0x3F000000          # 0.5
    a[300:364] = -np.abs(a[300:364])                 # a chunk with no positive value
    a[320] = -0.0
    a[380:444] = np.abs(a[380:444])                  # a chunk with no negative value
    got = extremes(a)
    for s in range(a.size - 63):
        q = a[s:s + 64]
        pos_nan = np.any(np.isnan(q) & ~np.signbit(q))
        neg_nan = np.any(np.isnan(q) & np.signbit(q))
        if np.any(q > 0) and not pos_nan:
            assert got[s, 0] == q[q > 0].max(), s
        elif not pos_nan:
            assert not got[s, 0] > 0, s
        if np.any(q < 0) and not neg_nan:
            assert got[s, 1] == q[q < 0].min(), s
        elif not neg_nan:
            assert not got[s, 1] < 0, s


def _thresholds_reference(sample, pi):
    """``(tau_pos, tau_neg)`` by sorting: the ``max(1, c // pi)``-th largest of
    the ``c`` positive values (of the negated negative values), inf for none."""
    out = []
    for sign in (1, -1):
        v = sample * np.float32(sign)
        top = np.sort(v[v > 0])[::-1]
        out.append(np.float32(np.inf) if top.size == 0 else top[max(1, top.size // pi) - 1])
    return tuple(out)


KINDS = ["normal", "ties", "plateau", "one_sign", "one_chunk", "tiny", "zeros", "nan"]


@pytest.mark.parametrize("kind", KINDS)
def test_sample_thresholds_against_a_sort(kind):
    """The adaptive thresholds of samples of every length from 1 to 700 (a
    shorter last chunk, 0 to 10 full ones) and proportions that make ``k``
    1, a few, more than the chunks and more than ``SMALL_K`` -- on data with
    ties at the answer (the starting bar is the answer's value), a plateau,
    one sign only, the positive values all in the first chunk (the other
    chunks' maxima are negative), subnormals, mostly zeros and NaN of both
    signs (which no comparison selects: the thresholds are those of the
    other values) -- against a sort."""
    from hpccomm.kernels import sparsify as S

    rng = np.random.default_rng(KINDS.index(kind))
    for size in list(range(1, 140)) + list(range(140, 701, 29)):
        x = rng.standard_normal(size).astype(np.float32)
        if kind == "ties":
            x = np.round(x * 2).astype(np.float32)
        elif kind == "plateau":
            x = np.where(np.abs(x) < 1.6, np.sign(x), x).astype(np.float32)
        elif kind == "one_sign":
            x = np.abs(x)
        elif kind == "one_chunk":
            x = -np.abs(x)
            x[:64] = np.abs(x[:64])
        elif kind == "tiny":
            x = (np.sign(x) * rng.integers(1, 4, size)).astype(np.float32) * np.float32(1e-45)
        elif kind == "zeros":
            x[rng.random(size) < 0.9] = 0.0
        else:
            x.view(np.uint32)[rng.random(size) < 0.05] = 0x7FC00000
            x.view(np.uint32)[rng.random(size) < 0.05] = 0xFFC00000
        pos = np.empty(size + 1, np.float32)
        neg = np.empty(size + 1, np.float32)
        for pi in (1, 2, 7, 64, 1000):
            got = S._sample_thresholds(x, pi, pos, neg)
            want = _thresholds_reference(x, pi)
            assert got == want, (size, pi)
