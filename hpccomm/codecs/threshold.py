"""``threshold``: Strom's threshold quantization (Interspeech 2015).

Parameters: at most one of ``tau`` (a fixed threshold, a normal float32:
Strom's form) or ``alpha`` (``tau = alpha * RMS(g)`` per call), and
``max_ratio`` (default 0.25); neither ``tau`` nor ``alpha`` means ``alpha =
1 / max_ratio`` (4 by default, see *Traffic*).  ``g`` is the *fresh* part
of the encoded vector (``EncodeContext.fresh``): under error feedback the
gradient ``g`` of ``v = g + e`` (the memory's
:meth:`~hpccomm.memory.Memory.fresh`; at an owner of ``twoshot``, the sum it
received), otherwise the vector itself.  RMS is summed in float64 in a fixed
order; ``tau`` goes into the packet, so decoding needs no parameter.

Each call emits at most one quantum per element: ``+tau`` at every ``i`` with
``v_i >= tau``, ``-tau`` where ``v_i <= -tau`` (LBANN's ``>=`` / ``<=``).
Error feedback (on by default: the codec is biased) keeps ``v_i -+ tau`` in
the residual, so a large element drains one ``tau`` per step -- Strom's rate
limit.  With ``alpha``, a fresh part whose RMS is 0 (all zeros) emits
nothing, and so does one whose ``tau`` would overflow float32.

Why ``g`` and not ``v``: the residual of an element below ``tau`` grows
until it is sent, and a ``tau`` taken from ``v`` grows with it -- elements
below ``alpha * RMS(g)`` were then never sent (the time average of a
repeated Gaussian kept a relative error of 0.96).  From ``g``, ``tau`` stays
put while the gradient's scale does, as Strom's fixed one: an element with
``|g_i| < tau`` sends a quantum every ``tau / |g_i|`` steps, its residual
stays within ``tau + |g_i|``, and the time average of what was sent
converges to ``g`` as ``1 / t``.

Traffic: in that steady state element ``i`` sends ``|g_i| / tau`` quanta per
step, so the fraction sent settles near ``mean|g| / tau <= 1 / alpha``
(``mean|g| <= RMS(g)``): ``0.8 / alpha`` for a Gaussian (0.2, ~6.4 bits per
element at ``alpha = 4``), less for heavier-tailed gradients.  The default
``alpha = 1 / max_ratio`` keeps that bound at the capacity below; a smaller
``alpha`` (or ``tau``) may ask for more than the capacity, and the excess
then piles up in the residual.  Elements with ``|g_i| > tau`` are held to
one quantum per step (the rate limit).  The first calls send less: only
what has reached ``tau``.

Capacity: at most ``cap = min(ceil(max_ratio * n), 2**32 - 1)`` entries per
packet.  When more elements qualify, the ``cap`` of largest ``|v_i|`` are sent
(ties to lower indices) and the others simply are not: their whole value stays
in the residual for the next step.  0.25 is where Strom's 32-bit words stop
being smaller than a dense 8-bit code (see the summable form).

Wire layout (version 1), little-endian::

    offset  size   field
    0       16     common header; extra = m (entries), n
    16      4      float32 tau (finite, > 0; 0 when m = 0)
    20      4      uint32 0 (padding: words start 8-byte aligned)
    24      w m    words (index << 1) | s, s = 1 for +tau and 0 for -tau, in
                   strictly increasing index order: uint32 (w = 4) when
                   n < 2**31, uint64 (w = 8) otherwise

Size ``24 + w m`` bytes: ``32 m / n`` bits per element plus ``192 / n``
(Strom's ``32 rho``).  ``max_wire_size(n) = 24 + w cap``.  Decoders reject
``m > cap``, a non-finite or negative ``tau``, non-zero padding, and words
whose indices are not strictly increasing inside ``[0, n)``.

Summable form (``tau`` given, so every rank shares it): ``shared_scale`` is
None, ``to_summable`` the dense int8 codes ``{-1, 0, +1}`` (no cap: the dense
vector has a fixed size), ``summable_dtype(P)`` int8 up to 127 ranks, int16 up
to 32767, int32 beyond, and ``from_summable`` gives ``tau * total`` -- 8 bits
per element, better than the words above a density of 1/4.
"""
import math
from typing import Optional

import numpy as np

from ..errors import PacketError
from ..kernels import sparsify as K
from ..kernels import threshold_slots as KT
from .sparsifier import (COUNT_MAX, WIDE_N, SparseCodec, check_count, check_fraction,
                      fraction_count, index_dtype, payload_view)
from .base import HEADER_SIZE, register_codec

#: bytes before the words: header, tau, padding
PREFIX = HEADER_SIZE + 8
F32_TINY = float(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)


def word_dtype(n: int) -> np.dtype:
    return np.dtype(np.uint32) if n < WIDE_N else np.dtype(np.uint64)


@register_codec
class Threshold(SparseCodec):
    name = "threshold"
    summable_when = "summable only with a fixed tau= (alpha= takes tau from each rank's data)"
    codec_id = 6

    def __init__(self, tau: Optional[float] = None, alpha: Optional[float] = None,
                 max_ratio: float = 0.25, nonfinite: str = "raise"):
        super().__init__(nonfinite=nonfinite)
        if tau is not None and alpha is not None:
            raise ValueError("threshold: pass at most one of tau (a fixed threshold) or alpha "
                             "(tau = alpha * RMS of the fresh gradient)")
        self.max_ratio = check_fraction("max_ratio", max_ratio)
        if tau is None and alpha is None:
            alpha = 1.0 / self.max_ratio
        for what, value in (("tau", tau), ("alpha", alpha)):
            if value is not None and not (np.isfinite(value) and value > 0):
                raise ValueError(f"threshold: {what} must be finite and > 0, not {value!r}")
        if tau is not None and not F32_TINY <= tau <= F32_MAX:
            raise ValueError(f"threshold: tau {tau!r} is outside float32's normal range")
        self.tau = None if tau is None else float(tau)
        self.alpha = None if alpha is None else float(alpha)
        #: the integer-code form needs one tau on every rank
        self.summable = self.tau is not None

    def params(self):
        p = {"max_ratio": self.max_ratio}
        if self.tau is not None:
            p["tau"] = self.tau
        else:
            p["alpha"] = self.alpha
        return p

    # -- sizes ---------------------------------------------------------------
    def max_count(self, n: int) -> int:
        return min(fraction_count(self.max_ratio, n), COUNT_MAX)

    def max_wire_size(self, n):
        return PREFIX + word_dtype(n).itemsize * self.max_count(n)

    def _payload_size(self, header):
        n, m = int(header["n"]), int(header["extra"])
        check_count(self, m, self.max_count(n), n)
        return PREFIX + word_dtype(n).itemsize * m

    # -- encode ----------------------------------------------------------------
    def _threshold(self, x, ctx, ss=None) -> np.float32:
        """``tau``: the fixed one, or ``alpha * RMS(g)`` of the fresh part
        ``g`` of ``x`` (``ctx.fresh``; ``x`` itself without it), ``ss`` its
        sum of squares when the caller has it."""
        if self.tau is not None:
            return np.float32(self.tau)
        if x.size == 0:
            return np.float32(0)
        if ss is None:
            g = x if ctx.fresh is None else ctx.fresh.reshape(-1)
            if g.size != x.size:
                raise ValueError(f"threshold: the fresh part has {g.size} elements, the "
                                 f"input {x.size}")
            ss = K.sum_squares(g)
        tau = self.alpha * math.sqrt(ss / x.size)
        return np.float32(tau) if tau <= F32_MAX else np.float32(np.inf)

    def _select(self, x, ctx, ss=None, tau=None):
        """``(tau, idx, vals)``: the elements that send a quantum, capped
        (``tau``: the threshold, when the caller has it)."""
        if tau is None:
            tau = self._threshold(x, ctx, ss)
        idt = index_dtype(x.size)
        if not (0 < tau < np.inf):  # alpha: all zeros, or beyond float32
            return tau, np.empty(0, idt), np.empty(0, np.float32)
        idx, vals = K.select_abs_ge(x, tau, idt)
        idx, vals = K.keep_largest(idx, vals, self.max_count(x.size))
        return tau, idx, vals

    def _pairs(self, x, ctx):
        tau, idx, vals = self._select(x, ctx)
        return idx, np.where(vals > 0, tau, -tau).astype(np.float32)

    def _packet(self, n, tau, idx, vals):
        m = idx.size
        packet = self.new_packet(PREFIX + word_dtype(n).itemsize * m, n, extra=m)
        packet[HEADER_SIZE:HEADER_SIZE + 4].view(np.float32)[0] = tau if m else 0
        K.pack_sign_words(idx, vals, packet[PREFIX:].view(word_dtype(n)))
        return packet

    def _encode(self, x, ctx):
        return self._packet(x.size, *self._select(x, ctx))

    def encode_with_feedback(self, x, e, e_out, ctx):
        """The packet of ``v = x + e`` (``v = x`` for ``e=None``) and ``e_out
        = v - decode(packet)`` without a dense decode -- the bits of encode,
        decode and subtract with ``ctx.fresh = x`` (:meth:`_feedback_packet`)."""
        return self._feedback_packet(*self._feedback_arrays(x, e, e_out))

    def _feedback_packet(self, x, e, e_out):
        """The packet of ``v = x + e`` with ``tau`` from the fresh ``x``, and
        ``e_out = v -+ tau`` at its entries (``v`` elsewhere).  For ``alpha``,
        the sum of squares of ``x`` first (a read of ``x``); then one pass
        over ``x`` and ``e`` forms ``v`` in ``e_out``, takes the quanta and
        collects the words (:func:`~hpccomm.kernels.sparsify.compensate_sign_quanta`),
        unless more than the capacity qualify: the largest then go, selected
        from ``v`` as :meth:`encode` does."""
        n = x.size
        tau = self._threshold(x, None, K.sum_squares(x) if self.tau is None else None)
        if not 0 < tau < np.inf:  # alpha: all zeros, or beyond float32 (or NaN)
            bad, _ = K.compensate(x, e, e_out, squares=False)
            self._raise_nonfinite(bad)
            return self._packet(n, tau, np.empty(0, index_dtype(n)), np.empty(0, np.float32))
        write, m, bad = K.compensate_sign_quanta(x, e, e_out, tau, self.max_count(n),
                                                 word_dtype(n))
        self._raise_nonfinite(bad)
        if write is None:
            tau, idx, vals = self._select(e_out, None, tau=tau)
            packet = self._packet(n, tau, idx, vals)
            K.subtract_sign_quanta(e_out, idx, vals, tau)
            return packet
        packet = self.new_packet(PREFIX + word_dtype(n).itemsize * m, n, extra=m)
        packet[HEADER_SIZE:HEADER_SIZE + 4].view(np.float32)[0] = tau if m else 0
        write(packet[PREFIX:].view(word_dtype(n)))
        return packet

    def owner_step(self, received, e, e_out, out, ctx):
        """The owner stage of ``twoshot``: every received packet validated
        (:meth:`_words`) before anything is written; their quanta added in
        rank order into ``out`` (zeroed: ``acc``); ``w = acc + e`` formed in
        ``e_out`` with the sum of squares of the fresh ``acc`` (for ``alpha``)
        in one pass, its quanta selected and subtracted at the sent entries
        (``e_out=None``: no owner residual, ``w = acc`` selected in place);
        then ``out = decode(packet)``.  The bits of decode-add, compensate,
        re-encode (``ctx.fresh = acc``), decode and subtract.  Returns the
        packet."""
        quanta = [self._words(packet, self.check_packet(packet, out)) for packet in received]
        out[:] = 0
        for tau, words in quanta:
            K.scatter_sign_words(words, tau, out, True)
        if e_out is None:
            packet = self._packet(out.size, *self._select(self._check_input(out), ctx))
        else:
            packet = self._feedback_packet(out, e, e_out)
        tau = packet[HEADER_SIZE:HEADER_SIZE + 4].view(np.float32)[0]
        out[:] = 0      # decode(packet): its words are the ones just packed
        K.scatter_sign_words(packet[PREFIX:].view(word_dtype(out.size)), tau, out, False)
        return packet

    # -- kernels on slots laid out once (hpccomm.kernels.threshold_slots) ------
    SLOT_STANDS_FOR = ("encode_with_feedback", "owner_step", "_decode_into", "_words",
                       "_pairs", "_select", "_threshold", "_feedback_packet", "_packet",
                       "max_count")
    SLOT_RULE = "slot_entries"

    def slot_entries(self, n: int, shape=None):
        """The capacity (words) of a slot of ``n`` elements where the slot
        kernels apply: one block's sum of squares, 32-bit words."""
        return self.max_count(n) if n <= K.BLOCK else None

    def slot_views(self, slot: np.ndarray, n: int, shape=None):
        """What the slot kernels take of ``slot`` (of :meth:`capacity_for`
        bytes for ``n`` elements), its header and padding written:
        ``(slot, tau as float32, words as uint32, capacity, scratch)``."""
        self.bind_header(slot, n)
        slot[HEADER_SIZE:PREFIX] = 0
        return (slot, slot[HEADER_SIZE:HEADER_SIZE + 4].view(np.float32),
                slot[PREFIX:].view(np.uint32), self.max_count(n), np.empty(n, np.float32))

    @staticmethod
    def row_views(slots: np.ndarray, n=None, shape=None):
        """Received slots (rows of one uint8 array, or one slot) as uint32
        and float32 words, header included."""
        return slots.view(np.uint32), slots.view(np.float32)

    def _tau_args(self):
        return (np.float32(self.tau) if self.tau is not None else np.float32(0.0),
                0.0 if self.alpha is None else self.alpha)

    def encode_slot(self, views, x, e, e_out, draw=None):
        """``encode_with_feedback`` of ``x`` into the slot of ``views``;
        returns the NaN/Inf count (the slot then not written)."""
        slot, tau_view, words, cap, mags = views
        return KT.encode_slot(x, x if e is None else e, e is not None, e_out, *self._tau_args(),
                              cap, mags, slot, tau_view, words)

    def owner_slot(self, rows, cap_in, e, e_out, out, views, draw=None):
        """:meth:`owner_step` from the received slots ``rows``
        (:meth:`row_views`, at most ``cap_in`` words each) into the slot of
        ``views``: 0, or :data:`~hpccomm.kernels.threshold_slots.BAD_PACKET`,
        or the NaN/Inf count (nothing sent written)."""
        slot, tau_view, words, cap, mags = views
        return KT.owner_slot(rows[0], rows[1], cap_in, out if e is None else e, e is not None,
                             out if e_out is None else e_out, e_out is not None, out,
                             *self._tau_args(), cap, mags, slot, tau_view, words)

    @staticmethod
    def decode_slot(row, cap, out) -> bool:
        """``decode`` of a received slot (:meth:`row_views`) of at most
        ``cap`` words into ``out``; False (nothing written) when not valid."""
        return KT.decode_slot(row[0], row[1], cap, out)

    # -- decode ----------------------------------------------------------------
    def _words(self, packet, header):
        """``(tau, words)`` of a size-checked packet, validated: ``tau``
        finite and not negative, zero padding, word indices strictly
        increasing inside ``[0, n)``."""
        n, m = int(header["n"]), int(header["extra"])
        tau = payload_view(packet, HEADER_SIZE, np.float32, 1)[0]
        pad = payload_view(packet, HEADER_SIZE + 4, np.uint32, 1)[0]
        if not (np.isfinite(tau) and tau >= 0) or pad != 0:
            raise PacketError(f"{self.name}: bad tau {tau!r} or padding {int(pad)}")
        words = payload_view(packet, PREFIX, word_dtype(n), m)
        if not K.sign_words_valid(words, n):
            raise PacketError(f"{self.name}: word indices are not strictly increasing "
                              f"inside [0, {n})")
        return tau, words

    def _decode_into(self, packet, header, out, add):
        tau, words = self._words(packet, header)
        if not add:
            out[:] = 0
        K.scatter_sign_words(words, tau, out, add)

    # -- summable form (tau given) -----------------------------------------------
    def _check_summable(self):
        if not self.summable:
            raise ValueError("threshold: the summable form needs a fixed tau shared by all "
                             "ranks (construct with tau=..., not alpha=...)")

    def shared_scale(self, x):
        self._check_summable()
        return None

    def to_summable(self, x, scale, ctx):
        self._check_summable()
        x = self._check_input(x)
        tau = np.float32(self.tau)
        return ((x >= tau).astype(np.int8) - (x <= -tau).astype(np.int8))

    def summable_dtype(self, nranks):
        self._check_summable()
        if nranks <= 127:
            return np.dtype(np.int8)
        if nranks <= 32767:
            return np.dtype(np.int16)
        return np.dtype(np.int32)

    def from_summable(self, total, scale, out, add=False):
        self._check_summable()
        values = np.float32(self.tau) * total.astype(np.float32)
        if add:
            out += values
        else:
            out[...] = values
        return out
