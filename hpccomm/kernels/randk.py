"""CPU kernels of the ``randk`` codec on its packets' fields
(:mod:`hpccomm.codecs.randk`): the encode with its residual, the owner step
of ``twoshot`` and the decode, each one call.

Every kernel derives the chunk's index key itself, ``hash_index(stream,
offset)`` (``stream``: the call's rank-independent random stream), and
regenerates the sorted indices from it with Floyd's algorithm
(:func:`~hpccomm.kernels.sparsify.floyd_indices`).  The key travels as two
little-endian uint32 words: packets of ``24 + 4 k`` bytes lie 4 bytes
apart at worst in a receive buffer.

The arithmetic is that of the codec's numpy steps, bit for bit:

* encode: ``v = x + e``; the values ``v[idx]``, times the float32 ``n / k``
  where scaled; ``e_out = v - decode`` (``v`` off the indices, ``v -
  value`` on them); NaN/Inf counted over all of ``v``;
* owner: ``acc = 0 + p_0 + p_1 + ...`` at each packet's own indices (rank
  order), ``w = acc + e`` (``0 + e`` off the indices); the values ``w[idx]`` unscaled (the sum is
  already scaled); ``e_out = w - decode`` and ``out = decode``; NaN/Inf
  counted over all of ``w``;
* decode: zeros, then the values at the packet's indices (or added).
"""
import numpy as np
from numba import njit

from .quant_common import _v
from .rng import hash_index_cpu
from .sparsify import floyd_indices

_LOW = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)


@njit(cache=True, nogil=True, inline="always")
def _key_of(words):
    """The uint64 key held as two little-endian uint32 ``words``."""
    return np.uint64(words[0]) | (np.uint64(words[1]) << _32)


@njit(cache=True, nogil=True, inline="always")
def _put_key(stream, offset, key_words):
    """The chunk's index key ``hash_index(stream, offset)``, written into
    ``key_words`` as two little-endian uint32; returns it."""
    key = hash_index_cpu(stream, np.uint64(offset))
    key_words[0] = np.uint32(key & _LOW)
    key_words[1] = np.uint32(key >> _32)
    return key


@njit(cache=True, nogil=True, inline="always")
def _indices(key, n, k):
    idx = np.empty(k, np.int64)
    floyd_indices(key, n, idx)
    return idx


@njit(cache=True, nogil=True)
def randk_encode(x, e, stream, offset, scale, scaled, count, key_words, vals, e_out):
    """The packet fields of ``v = x + e`` (``v = x`` for ``e=None``) at
    ``offset``: ``key_words`` and ``vals`` (``v[idx] * scale`` where
    ``scaled``); with ``e_out`` (else None), ``e_out = v - decode(packet)``.
    Returns the NaN/Inf count of ``v`` (0 without ``count``): a pass over
    ``v`` where ``e_out`` or ``count`` asks for one, then the ``k`` values."""
    n = x.size
    key = _put_key(stream, offset, key_words)
    bad = 0
    if e_out is not None:
        for i in range(n):
            v = _v(x, e, np.uint64(i))
            e_out[i] = v
            bad += np.int64((v - v) != 0)     # NaN exactly for inf and NaN
    elif count:
        for i in range(n):
            v = _v(x, e, np.uint64(i))
            bad += np.int64((v - v) != 0)
    k = vals.size
    if k:
        idx = _indices(key, n, k)
        for j in range(k):
            i = idx[j]
            v = _v(x, e, np.uint64(i))
            value = v * scale if scaled else v
            vals[j] = value
            if e_out is not None:
                e_out[i] = v - value
    return bad if count else 0


@njit(cache=True, nogil=True)
def randk_owner(key_rows, val_rows, e, stream, offset, key_words, vals, e_out, out):
    """The owner step of one chunk of ``m = out.size``: the received packets'
    fields as rows (rank order) and the owner residual ``e`` (None: none
    yet); the owner packet's ``key_words`` and ``vals``, ``e_out`` (None: no
    owner residual) and ``out = decode(packet)``.  Returns the NaN/Inf count
    of ``w``.

    Packets of the owner's key (the rule: every rank draws the same
    indices) are summed at those ``k`` indices alone, and the pass over the
    chunk reads ``e`` only (``acc`` is zero elsewhere).  A packet of
    another key decodes where its key says, as the separate steps decode
    it: the sum is then formed densely in ``out`` first."""
    m = out.size
    k = vals.size
    key = _put_key(stream, offset, key_words)
    idx = _indices(key, m, k)
    P = key_rows.shape[0]
    same = True
    for src in range(P):
        if _key_of(key_rows[src]) != key:
            same = False
    zero = np.float32(0.0)
    bad = 0
    if same:
        # acc = 0 + p_0 + p_1 + ... at the shared indices; w = 0 + e elsewhere
        for j in range(k):
            acc = zero
            for src in range(P):
                acc += val_rows[src, j]
            if e is None:
                vals[j] = acc
            else:
                vals[j] = acc + e[idx[j]]
        if e is None:
            out[:] = 0
            if e_out is not None:
                e_out[:] = 0
        else:
            for i in range(m):
                w = zero + e[i]
                bad += np.int64((w - w) != 0)
                out[i] = 0
                if e_out is not None:
                    e_out[i] = w
            for j in range(k):      # the pass saw 0 + e there, not w
                w = zero + e[idx[j]]
                bad -= np.int64((w - w) != 0)
    else:
        # acc densely in out, each packet at its own indices
        out[:] = 0
        for src in range(P):
            at = _indices(_key_of(key_rows[src]), m, k)
            for j in range(k):
                out[at[j]] += val_rows[src, j]
        for j in range(k):
            vals[j] = _v(out, e, np.uint64(idx[j]))
        for i in range(m):
            w = _v(out, e, np.uint64(i))
            bad += np.int64((w - w) != 0)
            out[i] = 0
            if e_out is not None:
                e_out[i] = w
        for j in range(k):      # counted below at their w
            bad -= np.int64((vals[j] - vals[j]) != 0)
    for j in range(k):
        i = idx[j]
        value = vals[j]
        bad += np.int64((value - value) != 0)
        out[i] = value
        if e_out is not None:
            e_out[i] = value - value
    return bad


@njit(cache=True, nogil=True)
def randk_decode(key_words, vals, out, add):
    """``out = decode`` (``add``: ``out += decode``) of a packet's fields."""
    k = vals.size
    if not add:
        out[:] = 0
    if k:
        idx = _indices(_key_of(key_words), out.size, k)
        for j in range(k):
            if add:
                out[idx[j]] += vals[j]
            else:
                out[idx[j]] = vals[j]
