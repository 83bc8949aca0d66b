"""Strom's threshold quanta in packets laid out once: the kernels of a
repeated small ``twoshot`` call of ``threshold``
(:meth:`hpccomm.codecs.threshold.Threshold.slot_entries`).

A slot is a threshold packet's bytes at its capacity for ``cap`` words
(``24 + 4 cap``; :mod:`hpccomm.codecs.threshold`'s layout, uint32 words),
its header written once but for the count (``extra``, bytes 4-7), its
padding (bytes 20-23) zero; the kernels write the count, ``tau`` (through
``tau_view``, bytes 16-19 as float32) and the words (``words``, from byte
24).  Received slots are read as uint32 / float32 words, header included:
word 1 the count, word 4 ``tau``, word 5 the padding, words 6... the words.

``tau`` is the codec's: a fixed one, or ``alpha * RMS`` of the fresh part
(its sum of squares as :func:`~hpccomm.kernels.sparsify.sum_squares` adds
it for one block).  The quanta are the codec's: every ``|v_i| >= tau``, or,
above the capacity, the ``cap`` of largest ``|v_i|`` (ties to the lower
index); the residual keeps ``v_i -+ tau`` at them.  Every kernel checks
before it sends: a packet with too many words, a bad ``tau`` or padding, or
word indices out of order, and NaN/Inf in what it selects from, are
reported (the caller raises the codec's error by running the general
path's step on the same bytes).
"""
import math

import numpy as np
from numba import njit

from .slots import BAD_PACKET, count_nonfinite, kth_magnitude, owner_sum, put_count
from .sparsify import _sum_squares_of

__all__ = ["BAD_PACKET", "encode_slot", "owner_slot", "decode_slot"]

_F32_MAX = float(np.finfo(np.float32).max)
_ONE = np.uint32(1)


@njit(cache=True, nogil=True)
def _tau_of(g, fixed, alpha):
    """``fixed`` where it is > 0, else ``alpha * sqrt(sum(g^2) / n)`` in
    float64, rounded to float32 (inf beyond its range, 0 for ``n = 0``)."""
    if fixed > 0:
        return fixed
    if g.size == 0:
        return np.float32(0.0)
    tau = alpha * math.sqrt((0.0 + _sum_squares_of(g)) / g.size)
    return np.float32(tau) if tau <= _F32_MAX else np.float32(np.inf)


@njit(cache=True, nogil=True)
def _quanta_into(v, tau, cap, mags, slot, tau_view, words, subtract):
    """The quanta of finite ``v`` at ``tau`` into the slot (count, ``tau``
    where any, words), ``v -+ tau`` at them with ``subtract``.  Returns the
    count."""
    n = v.size
    m = 0
    if 0 < tau < np.inf:
        count = 0
        for i in range(n):
            count += abs(v[i]) >= tau
        cut = tau
        ties = n            # every candidate at the cut is taken
        if count > cap:     # the cap largest: the cap-th largest magnitude, ties low
            cut, greater = kth_magnitude(v, cap, mags)
            ties = cap - greater
        for i in range(n):
            a = abs(v[i])
            if (a > cut or (a == cut and ties > 0)) and m < cap:   # (never past the slot)
                ties -= a == cut
                pos = v[i] > 0
                words[m] = (np.uint32(i) << _ONE) | np.uint32(pos)
                if subtract:
                    v[i] = v[i] - (tau if pos else -tau)
                m += 1
    put_count(slot, m)
    tau_view[0] = tau if m else np.float32(0.0)
    return m


@njit(cache=True, nogil=True)
def encode_slot(x, e, has_e, e_out, fixed, alpha, cap, mags, slot, tau_view, words):
    """``encode_with_feedback``: ``tau`` from the fresh ``x``; ``v = x + e``
    (``x`` without ``e``) into ``e_out``; its quanta into the slot and
    ``e_out = v -+ tau`` at them.  Returns the NaN/Inf count of ``v`` (the
    slot then not written)."""
    tau = _tau_of(x, fixed, alpha)
    for i in range(x.size):
        e_out[i] = x[i] + e[i] if has_e else x[i]
    bad = count_nonfinite(e_out)
    if bad:
        return bad
    _quanta_into(e_out, tau, cap, mags, slot, tau_view, words, True)
    return 0


@njit(cache=True, nogil=True)
def _row_valid(row_u, row_f, cap, m):
    c = np.int64(row_u[1])
    tau = row_f[4]
    if c > cap or not (np.isfinite(tau) and tau >= 0) or row_u[5] != 0:
        return False
    prev = -1
    for o in range(c):
        i = np.int64(row_u[6 + o] >> _ONE)
        if i <= prev or i >= m:
            return False
        prev = i
    return True


@njit(cache=True, nogil=True, inline="always")
def _scatter_row(row_u, row_f, out, add):
    c = np.int64(row_u[1])
    tau = row_f[4]
    neg = -tau
    for o in range(c):
        w = row_u[6 + o]
        i = np.int64(w >> _ONE)
        q = tau if (w & _ONE) else neg
        if add:
            out[i] += q
        else:
            out[i] = q


@njit(cache=True, nogil=True)
def owner_slot(rows_u, rows_f, cap_in, e, has_e, e_out, has_e_out, out, fixed, alpha, cap, mags,
               slot, tau_view, words):
    """``twoshot``'s owner step on received slots (rows of uint32 / float32
    words, at most ``cap_in`` words each): validated, their quanta added
    into ``out`` (zeroed) in rank order; ``tau`` from that sum; ``w = out +
    e`` into ``e_out`` (``has_e_out``; else ``w = out``); its quanta into
    the owner's slot (``e_out -+= tau`` at them); ``out = decode(slot)``.
    Returns 0, :data:`BAD_PACKET` (nothing written), or the NaN/Inf count
    of ``w`` (the slot not written)."""
    m = out.size
    for j in range(rows_u.shape[0]):
        if not _row_valid(rows_u[j], rows_f[j], cap_in, m):
            return BAD_PACKET
    out[:] = 0
    for j in range(rows_u.shape[0]):
        _scatter_row(rows_u[j], rows_f[j], out, True)
    tau = _tau_of(out, fixed, alpha)
    v, bad = owner_sum(out, e, has_e, e_out, has_e_out)
    if bad:
        return bad
    c = _quanta_into(v, tau, cap, mags, slot, tau_view, words, has_e_out)
    out[:] = 0
    neg = -tau
    for o in range(c):
        w = words[o]
        out[np.int64(w >> _ONE)] = tau if (w & _ONE) else neg
    return 0


@njit(cache=True, nogil=True)
def decode_slot(row_u, row_f, cap, out):
    """``out = decode(slot)`` of a received slot of at most ``cap`` words
    (uint32 / float32 words); False (nothing written) when not valid."""
    if not _row_valid(row_u, row_f, cap, out.size):
        return False
    out[:] = 0
    _scatter_row(row_u, row_f, out, False)
    return True
