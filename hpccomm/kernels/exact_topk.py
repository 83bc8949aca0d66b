"""Exact top-k in pair packets laid out once: the kernels of a repeated
small ``twoshot`` call of ``topk`` and ``dgc`` where their selection is the
exact top-k (:meth:`hpccomm.codecs.topk.PairCodec.exact_count`).

A slot is a pair packet's bytes at their capacity for ``k`` entries
(``16 + 8 k``; int32 indices, :mod:`hpccomm.codecs.topk`'s layout), its
header written once but for the count (``extra``, bytes 4-7), and read
through two views of its payload made once: ``words_i`` (int32) and
``words_f`` (float32), ``2 k`` words each.  A packet of ``c`` entries holds
its indices in ``words_i[:c]`` and its values in ``words_f[c:2 c]``.

The selection is the codec's at ``s == n``: the ``k`` entries of largest
magnitude, ties at the cut to the lower indices, zeros never sent (all
non-zeros when fewer than ``k``), in index order -- from the ``k``-th largest
magnitude (:func:`~hpccomm.kernels.slots.kth_magnitude`) and one pass.
Every kernel checks before it writes: a packet that announces too many
entries or indices out of order, and NaN/Inf in what it selects from, are
reported (the caller raises the codec's own error by running the general
path's step on the same bytes).
"""
import numpy as np
from numba import njit

from .slots import BAD_PACKET, count_nonfinite, kth_magnitude, owner_sum, put_count

__all__ = ["BAD_PACKET", "encode_slot", "owner_slot", "decode_slot"]


@njit(cache=True, nogil=True)
def _top_into(v, k, mags, slot, words_i, words_f):
    """The exact top-``k`` of finite ``v`` into ``slot`` (count, indices,
    values); ``mags``: scratch of ``v.size``.  Returns the count."""
    n = v.size
    if 0 < k < n:
        t, greater = kth_magnitude(v, k, mags)
    else:                       # every non-zero
        t, greater = np.float32(0.0), 0
        for i in range(n):
            greater += abs(v[i]) > t
    if t > 0:                   # k entries: all above the cut, the first ties at it
        c, ties = k, k - greater
    else:                       # fewer than k non-zeros: all of them
        c, ties = greater, 0
    o = 0
    for i in range(n):
        a = abs(v[i])
        if (a > t or (a == t and ties > 0)) and o < c:     # (o < c: never past the slot)
            ties -= a == t
            words_i[o] = i
            words_f[c + o] = v[i]
            o += 1
    put_count(slot, o)
    return o


@njit(cache=True, nogil=True)
def encode_slot(x, e, has_e, e_out, k, mags, slot, words_i, words_f):
    """``v = x + e`` (``x`` without ``e``) into ``e_out``; its exact top-``k``
    into the slot and ``e_out -= decode(slot)``.  Returns the NaN/Inf count
    of ``v`` (the slot then not written)."""
    for i in range(x.size):
        e_out[i] = x[i] + e[i] if has_e else x[i]
    bad = count_nonfinite(e_out)
    if bad:
        return bad
    c = _top_into(e_out, k, mags, slot, words_i, words_f)
    for o in range(c):
        e_out[words_i[o]] -= words_f[c + o]
    return 0


@njit(cache=True, nogil=True)
def _rows_valid(rows_i, m, k_in):
    for j in range(rows_i.shape[0]):
        c = rows_i[j, 1]
        if c < 0 or c > k_in:
            return False
        prev = -1
        for o in range(c):
            i = rows_i[j, 4 + o]
            if i <= prev or i >= m:
                return False
            prev = i
    return True


@njit(cache=True, nogil=True)
def owner_slot(rows_i, rows_f, k_in, e, has_e, e_out, has_e_out, out, k, mags, slot, words_i,
               words_f):
    """``twoshot``'s owner step on received slots: ``rows_i`` / ``rows_f``
    (the received slots as int32 / float32 rows, at most ``k_in`` entries
    each) validated, their pairs added into ``out`` (zeroed) in rank order;
    ``w = out + e`` into ``e_out`` (``has_e_out``; else ``w = out``); its
    exact top-``k`` into the owner's slot; ``out = decode(slot)`` and
    ``e_out -= decode(slot)``.  Returns 0, :data:`BAD_PACKET` (nothing
    written), or the NaN/Inf count of ``w`` (the slot not written)."""
    m = out.size
    if not _rows_valid(rows_i, m, k_in):
        return BAD_PACKET
    out[:] = 0
    for j in range(rows_i.shape[0]):
        c = rows_i[j, 1]
        for o in range(c):
            out[rows_i[j, 4 + o]] += rows_f[j, 4 + c + o]
    v, bad = owner_sum(out, e, has_e, e_out, has_e_out)
    if bad:
        return bad
    c = _top_into(v, k, mags, slot, words_i, words_f)
    out[:] = 0
    for o in range(c):
        out[words_i[o]] = words_f[c + o]
    if has_e_out:
        for o in range(c):
            e_out[words_i[o]] -= words_f[c + o]
    return 0


@njit(cache=True, nogil=True)
def decode_slot(row_i, row_f, k, out):
    """``out = decode(slot)`` of a received slot of at most ``k`` entries
    (``row_i`` / ``row_f``: the slot as int32 / float32 words); False
    (nothing written) when it is not valid."""
    c = row_i[1]
    if c < 0 or c > k:
        return False
    prev = -1
    for o in range(c):
        i = row_i[4 + o]
        if i <= prev or i >= out.size:
            return False
        prev = i
    out[:] = 0
    for o in range(c):
        out[row_i[4 + o]] = row_f[4 + c + o]
    return True
