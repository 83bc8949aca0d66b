"""Adaptive quantization in packets laid out once: the kernels of a repeated
small ``twoshot`` call of ``adaptive``
(:meth:`hpccomm.codecs.adaptive.Adaptive.slot_entries`: its columns in one
group of :func:`~hpccomm.kernels.sparsify.adaptive_encode`).

A slot is an adaptive packet's bytes at its capacity for the column length
``H`` of the call's shape (:meth:`~hpccomm.codecs.adaptive.Adaptive.capacity_for`),
read and written as uint32 / float32 words from its start: word 1 the count
``m`` (the header's ``extra``), word 4 ``H``, then per column ``c`` its count
(word ``5 + 3 c``) and means (``6 + 3 c``, ``7 + 3 c``), then from word
``5 + 3 W`` the ``m`` words ``(row << 1) | s``.  The kernels run the codec's
own column kernel (:func:`~hpccomm.kernels.sparsify._adaptive_group`), its
validation and its decode on those words, so they give its bits; a packet
they refuse (another ``H``, counts or rows out of bounds) and NaN/Inf are
reported, and the caller raises the codec's error by running the general
path's step on the same bytes.
"""
import numpy as np
from numba import njit

from .slots import BAD_PACKET
from .sparsify import _adaptive_group, adaptive_scatter, adaptive_valid

__all__ = ["BAD_PACKET", "encode_slot", "owner_slot", "decode_slot"]


@njit(cache=True, nogil=True)
def _put(su, sf, H, counts, mu_pos, mu_neg, words, k):
    """The encode's fields and its ``k`` words into the slot's words."""
    W = counts.size
    su[1] = np.uint32(k)
    su[4] = np.uint32(H)
    for c in range(W):
        su[5 + 3 * c] = np.uint32(counts[c])
        sf[6 + 3 * c] = mu_pos[c]
        sf[7 + 3 * c] = mu_neg[c]
    base = 5 + 3 * W
    for j in range(k):
        su[base + j] = words[j]


@njit(cache=True, nogil=True)
def _valid(ru, n, H, k_max, pi, excess):
    """Whether the slot of words ``ru`` holds a packet of ``n`` elements in
    columns of ``H`` with at most ``k_max`` words (its own checks:
    :func:`~hpccomm.kernels.sparsify.adaptive_valid`)."""
    m = np.int64(ru[1])
    if m > k_max or np.int64(ru[4]) != H:
        return False
    W = (n + H - 1) // H
    return adaptive_valid(n, H, ru[5:5 + 3 * W:3], ru[5 + 3 * W:5 + 3 * W + m], pi, excess)


@njit(cache=True, nogil=True)
def _scatter(ru, rf, n, H, out, add):
    m = np.int64(ru[1])
    W = (n + H - 1) // H
    adaptive_scatter(n, H, ru[5:5 + 3 * W:3], rf[6:6 + 3 * W:3], rf[7:7 + 3 * W:3],
                     ru[5 + 3 * W:5 + 3 * W + m], out, add)


@njit(cache=True, nogil=True)
def encode_slot(x, e, has_e, e_out, H, pi, samples, excess, key, base, counts, mu_pos, mu_neg,
                words, su, sf):
    """``encode_with_feedback`` of ``x`` (its random stream ``key``, chunk
    offset ``base``) into the slot's words ``su`` / ``sf``; ``counts``,
    ``mu_*`` (a column each) and ``words`` (one more than the slot holds)
    are scratch.  Returns the NaN/Inf count (the slot then not written)."""
    k, bad = _adaptive_group(x, e, has_e, True, H, 0, counts.size, pi, samples, excess, key,
                             base, e_out, counts, mu_pos, mu_neg, words)
    if bad:
        return bad
    _put(su, sf, H, counts, mu_pos, mu_neg, words, k)
    return 0


@njit(cache=True, nogil=True)
def owner_slot(rows_u, rows_f, k_in, H, e, has_e, e_out, has_e_out, out, pi, samples, excess,
               key, base, counts, mu_pos, mu_neg, words, su, sf):
    """``twoshot``'s owner step on received slots (rows of uint32 / float32
    words, at most ``k_in`` words each, columns of ``H``): validated, added
    into ``out`` (zeroed) in rank order; ``w = out + e`` encoded column by
    column in ``e_out`` (``has_e_out``; else ``w = out`` where it lies) into
    the owner's slot; ``out = decode(slot)``.  Returns 0,
    :data:`BAD_PACKET` (nothing written), or the NaN/Inf count of ``w``
    (the slot not written)."""
    n = out.size
    for j in range(rows_u.shape[0]):
        if not _valid(rows_u[j], n, H, k_in, pi, excess):
            return BAD_PACKET
    out[:] = 0
    for j in range(rows_u.shape[0]):
        _scatter(rows_u[j], rows_f[j], n, H, out, True)
    if has_e_out:
        k, bad = _adaptive_group(out, e, has_e, True, H, 0, counts.size, pi, samples, excess,
                                 key, base, e_out, counts, mu_pos, mu_neg, words)
    else:
        k, bad = _adaptive_group(out, out, False, False, H, 0, counts.size, pi, samples, excess,
                                 key, base, out, counts, mu_pos, mu_neg, words)
    if bad:
        return bad
    _put(su, sf, H, counts, mu_pos, mu_neg, words, k)
    adaptive_scatter(n, H, counts, mu_pos, mu_neg, words[:k], out, False)
    return 0


@njit(cache=True, nogil=True)
def decode_slot(row_u, row_f, H, k, pi, excess, out):
    """``out = decode(slot)`` of a received slot of at most ``k`` words in
    columns of ``H``; False (nothing written) when not valid."""
    if not _valid(row_u, out.size, H, k, pi, excess):
        return False
    _scatter(row_u, row_f, out.size, H, out, False)
    return True
