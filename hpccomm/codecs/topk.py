"""``topk``: keep the ``k`` largest magnitudes (Aji & Heafield, EMNLP 2017).

Parameters: ``ratio`` (default 0.01) and ``exact`` (default False).  A vector
of ``n > 0`` elements keeps ``k = max(1, ceil(ratio * n))`` entries
(:func:`~hpccomm.codecs.sparsifier.fraction_count`; at most ``2**32 - 1``, the
largest count the header holds).  The rest is dropped: the codec is biased,
error feedback keeps the dropped part in the residual (on by default).

Selection (zeros are never sent, so fewer than ``k`` entries go out when
``x`` has fewer than ``k`` non-zeros):

1. Threshold from a strided sample: ``s = min(n, max(4096, ceil(256 / ratio)))``
   magnitudes at ``start + j * (n // s)``, ``j < s``, the start drawn with the
   counter RNG (``hash_index(stream_key(seed, rank, step, SALT), offset)``;
   a random offset, because fixed strides are biased on structured tensors).
   ``t`` is the ``r``-th largest sample with ``r = min(s, ceil(1.25 * ratio * s))``:
   a 25 % margin, so that with 256 expected sampled hits at least ``k``
   elements pass with near certainty.  When ``s == n`` (short vectors) the
   sample is the vector and ``t`` is the exact ``k``-th largest magnitude;
   when ``k == n``, ``t = 0``.
2. Candidates: every ``i`` with ``|x_i| >= t`` and ``x_i != 0``, in index order.
3. More than ``k`` candidates: keep the ``k`` largest magnitudes, ties at the
   cut going to the lower index.  Whenever at least ``k`` elements pass ``t``
   this *is* the exact top-k (every element of the top-k clears ``t``).
4. Fewer than ``k`` candidates although ``t > 0`` (the sample overshot):
   ``exact=False`` accepts them as they are (Aji & Heafield's behaviour);
   ``exact=True`` recomputes ``t`` as the exact ``k``-th largest magnitude of
   the whole vector (``np.partition``, one more O(n) pass) and selects again.

So the packet holds ``m <= k`` entries; with ``exact=True`` exactly
``min(k, nnz(x))``, the top-k with ties broken towards lower indices.

Wire layout (version 1), little-endian, two arrays as in Marian's
SparseTensor and DGC::

    offset          size   field
    0               16     common header; extra = m (entries), n
    16              b m    indices, strictly increasing: int32 (b = 4) when
                           n < 2**31, int64 (b = 8) otherwise
    16 + b m        4 m    float32 values, in the same order

Size ``16 + (b + 4) m`` bytes: ``64 m / n`` bits per element plus ``128 / n``
(0.64 + 128/n at ratio 0.01).  ``max_wire_size(n) = 16 + (b + 4) k``.
Decoders reject ``m > k``, and indices that are not strictly increasing
inside ``[0, n)``, before anything is written.

:mod:`hpccomm.codecs.dgc` reuses this layout (:func:`pack_pairs`,
:func:`unpack_pairs`) under its own codec id.
"""
import math

import numpy as np

from ..errors import PacketError
from ..kernels import exact_topk as KS
from ..kernels import sparsify as K
from ..kernels.rng import stream_key
from .sparsifier import (COUNT_MAX, SparseCodec, check_count, check_fraction, fraction_count,
                      index_dtype, payload_view)
from .base import HEADER_SIZE, register_codec

SALT = 0x746F706B  # "topk"
#: sample size: at least this many ...
MIN_SAMPLES = 4096
#: ... and enough for this many expected hits at the sample's threshold
SAMPLED_HITS = 256
#: the sampled threshold aims at MARGIN * k candidates
MARGIN = 1.25


def pairs_size(n: int, m: int) -> int:
    """Bytes of a pair packet with ``m`` entries for ``n`` elements."""
    return HEADER_SIZE + m * (index_dtype(n).itemsize + 4)


def pack_pairs(codec, n: int, idx: np.ndarray, vals: np.ndarray) -> np.ndarray:
    """A pair packet (layout above) from sorted ``idx`` / float32 ``vals``."""
    m = idx.size
    idt = index_dtype(n)
    packet = codec.new_packet(pairs_size(n, m), n, extra=m)
    cut = HEADER_SIZE + m * idt.itemsize
    packet[HEADER_SIZE:cut].view(idt)[:] = idx
    packet[cut:].view(np.float32)[:] = vals
    return packet


def unpack_pairs(codec, packet: np.ndarray, header):
    """``(idx, vals)`` of a size-checked pair packet, indices validated."""
    n, m = int(header["n"]), int(header["extra"])
    idt = index_dtype(n)
    idx = payload_view(packet, HEADER_SIZE, idt, m)
    vals = payload_view(packet, HEADER_SIZE + m * idt.itemsize, np.float32, m)
    if not K.indices_valid(idx, n):
        raise PacketError(f"{codec.name}: indices are not strictly increasing inside [0, {n})")
    return idx, vals


def decode_pairs(codec, packet: np.ndarray, header, out: np.ndarray, add: bool) -> None:
    idx, vals = unpack_pairs(codec, packet, header)
    if not add:
        out[:] = 0
    K.scatter(out, idx, vals, add)


def top_count(ratio: float, n: int) -> int:
    """``k = max(1, ceil(ratio n))`` (at most ``n`` and ``2**32 - 1``); 0 for ``n = 0``."""
    if n == 0:
        return 0
    return min(n, max(1, fraction_count(ratio, n)), COUNT_MAX)


class PairCodec(SparseCodec):
    """Common part of ``topk`` and ``dgc``: a ``ratio``, the pair layout and
    the selection's shape (a sampled threshold, the candidates, a finish)."""

    #: the sample's start is random
    stochastic = True

    def __init__(self, ratio: float, nonfinite: str = "raise"):
        super().__init__(nonfinite=nonfinite)
        self.ratio = check_fraction("ratio", ratio)

    def max_count(self, n: int) -> int:
        return top_count(self.ratio, n)

    def max_wire_size(self, n):
        return pairs_size(n, self.max_count(n))

    def _payload_size(self, header):
        n, m = int(header["n"]), int(header["extra"])
        check_count(self, m, self.max_count(n), n)
        return pairs_size(n, m)

    def _encode(self, x, ctx):
        idx, vals = self._pairs(x, ctx)
        return pack_pairs(self, x.size, idx, vals)

    def _decode_into(self, packet, header, out, add):
        decode_pairs(self, packet, header, out, add)

    # -- selection: a threshold from a strided sample, the candidates at it,
    # then the codec's own finish (subclasses)
    def _sample_size(self, n: int, k: int) -> int:
        """Magnitudes sampled for the threshold of ``n`` elements keeping
        ``k`` (``n`` itself: the threshold needs the whole vector)."""
        raise NotImplementedError

    def _threshold(self, sample: np.ndarray, n: int, k: int) -> np.float32:
        """The first threshold for ``n`` elements keeping ``k``, from the
        sampled magnitudes (all ``n`` of them where :meth:`_sample_size` says
        ``n``)."""
        raise NotImplementedError

    def _finish(self, x, t, idx, vals, k):
        """The pairs that go out, from the candidates ``(idx, vals)`` of ``x``
        at ``t``."""
        raise NotImplementedError

    def _key(self, ctx):
        return stream_key(ctx.seed, ctx.rank, ctx.step, self.salt)

    def _pairs(self, x, ctx):
        n = x.size
        k = self.max_count(n)
        idt = index_dtype(n)
        if k == 0:
            return np.empty(0, idt), np.empty(0, np.float32)
        s = self._sample_size(n, k)
        t = self._threshold(np.abs(x) if s == n else
                            K.strided_sample_abs(x, s, self._key(ctx), ctx.offset), n, k)
        idx, vals = K.select_abs_ge(x, t, idt)
        return self._finish(x, t, idx, vals, k)

    def _select_compensated(self, x, e, e_out, ctx):
        """The pairs of ``v = x + e`` (``v = x`` for ``e=None``), ``v`` written
        to ``e_out``: where the threshold comes from a sample, in one pass over
        ``x`` and ``e`` (:func:`~hpccomm.kernels.sparsify.compensate_select`:
        its candidates at the sample's threshold collected, NaN/Inf counted),
        else ``v`` formed in ``e_out`` and selected from there."""
        n = x.size
        k = self.max_count(n)
        s = self._sample_size(n, k) if k else n
        if s < n:
            sample = K.strided_sample_abs(x, s, self._key(ctx), ctx.offset, e)
            t = self._threshold(sample, n, k)
            idx, vals, bad = K.compensate_select(x, e, e_out, t, index_dtype(n),
                                                 np.count_nonzero(sample >= t) / s)
            self._raise_nonfinite(bad)
            return self._finish(e_out, t, idx, vals, k)
        if e is None:
            np.copyto(e_out, x)
        else:
            np.add(x, e, out=e_out)
        return self._pairs(self._check_input(e_out), ctx)

    def encode_with_feedback(self, x, e, e_out, ctx):
        """The packet of ``v = x + e`` and ``e_out = v - decode(packet)``
        without a dense decode: :meth:`_select_compensated`, then only the
        sent entries are corrected (``e_out[idx] -= vals``,
        :func:`~hpccomm.kernels.sparsify.subtract_at`; ``v - 0.0 == v``
        elsewhere).  The bits of the three steps."""
        x, e, e_out = self._feedback_arrays(x, e, e_out)
        idx, vals = self._select_compensated(x, e, e_out, ctx)
        packet = pack_pairs(self, x.size, idx, vals)
        K.subtract_at(e_out, idx, vals)
        return packet

    # -- kernels on slots laid out once (twoshot's plan of a repeated small
    # call, hpccomm.kernels.exact_topk): where the selection is exact
    def exact_count(self, n: int, shape=None):
        """``k`` where this codec's selection of ``n`` elements is the exact
        top-``k`` (its threshold taken from the whole vector, nothing drawn),
        else None."""
        raise NotImplementedError

    #: what the slot kernels do in place of the codec's own steps
    SLOT_STANDS_FOR = ("encode_with_feedback", "owner_step", "_decode_into", "_pairs",
                       "_select_compensated", "_sample_size", "_threshold", "_finish",
                       "max_count")
    SLOT_RULE = "exact_count"

    def slot_views(self, slot: np.ndarray, n: int, shape=None):
        """What the slot kernels take of ``slot`` (of :meth:`capacity_for`
        bytes for ``n`` elements), its header written but for the count:
        ``(slot, payload as int32, as float32, k, scratch)``."""
        k = self.max_count(n)
        self.bind_header(slot, n)
        return (slot, slot[HEADER_SIZE:].view(np.int32), slot[HEADER_SIZE:].view(np.float32),
                k, np.empty(n, np.float32))

    @staticmethod
    def row_views(slots: np.ndarray, n=None, shape=None):
        """Received slots (rows of one uint8 array, or one slot) as int32
        and float32 words, header included."""
        return slots.view(np.int32), slots.view(np.float32)

    @staticmethod
    def encode_slot(views, x, e, e_out, draw=None):
        """``encode_with_feedback`` of ``x`` into the slot of ``views``, where
        :meth:`exact_count` applies; returns the NaN/Inf count (the slot
        then not written)."""
        slot, wi, wf, k, mags = views
        return KS.encode_slot(x, x if e is None else e, e is not None, e_out, k, mags, slot,
                              wi, wf)

    @staticmethod
    def owner_slot(rows, k_in, e, e_out, out, views, draw=None):
        """:meth:`owner_step` from the received slots ``rows``
        (:meth:`row_views`, at most ``k_in`` entries each) into the slot of
        ``views``: 0, or :data:`~hpccomm.kernels.exact_topk.BAD_PACKET`, or
        the NaN/Inf count (nothing sent written)."""
        slot, wi, wf, k, mags = views
        return KS.owner_slot(rows[0], rows[1], k_in, out if e is None else e, e is not None,
                             out if e_out is None else e_out, e_out is not None, out, k, mags,
                             slot, wi, wf)

    @staticmethod
    def decode_slot(row, k, out) -> bool:
        """``decode`` of a received slot (:meth:`row_views`) of at most ``k``
        entries into ``out``; False (nothing written) when not valid."""
        return KS.decode_slot(row[0], row[1], k, out)

    def owner_step(self, received, e, e_out, out, ctx):
        """The owner stage of ``twoshot``: every received packet validated
        (header, size, indices) before anything is written; their pairs
        added in rank order into ``out`` (zeroed: ``acc``); the pairs of
        ``w = acc + e`` with ``w`` in ``e_out`` (:meth:`_select_compensated`;
        ``e_out=None``: no owner residual, ``w = acc``, selected in place);
        then ``out = decode(packet)`` and ``e_out -= decode(packet)`` at the
        sent entries.  About two passes over the chunk where the separate
        steps make eight; the bits of decode-add, compensate, re-encode,
        decode and subtract.  Returns the packet."""
        pairs = [unpack_pairs(self, packet, self.check_packet(packet, out))
                 for packet in received]
        out[:] = 0
        for idx, vals in pairs:
            K.scatter(out, idx, vals, True)
        if e_out is None:
            idx, vals = self._pairs(self._check_input(out), ctx)
        else:
            idx, vals = self._select_compensated(out, e, e_out, ctx)
        packet = pack_pairs(self, out.size, idx, vals)
        out[:] = 0
        K.scatter(out, idx, vals, False)
        if e_out is not None:
            K.subtract_at(e_out, idx, vals)
        return packet


@register_codec
class TopK(PairCodec):
    name = "topk"
    codec_id = 8
    salt = SALT

    def __init__(self, ratio: float = 0.01, exact: bool = False, nonfinite: str = "raise"):
        super().__init__(ratio, nonfinite=nonfinite)
        self.exact = bool(exact)

    def params(self):
        return {"ratio": self.ratio, "exact": self.exact}

    def sample_size(self, n: int) -> int:
        """Strided samples taken for a vector of ``n`` elements."""
        return min(n, max(MIN_SAMPLES, math.ceil(SAMPLED_HITS / self.ratio)))

    def _sample_size(self, n, k):
        return n if k == n else self.sample_size(n)

    def exact_count(self, n, shape=None):
        k = self.max_count(n)
        return k if self._sample_size(n, k) == n else None

    def _threshold(self, sample, n, k):
        if k == n:     # every non-zero passes
            return np.float32(0.0)
        if sample.size == n:   # the whole vector: exact
            return K.kth_largest(sample, k)
        s = sample.size
        return K.kth_largest(sample, min(s, math.ceil(MARGIN * self.ratio * s)))

    def _finish(self, x, t, idx, vals, k):
        if self.exact and vals.size < k and t > 0:
            idx, vals = K.select_abs_ge(x, K.kth_largest(np.abs(x), k), index_dtype(x.size))
        return K.keep_largest(idx, vals, k)
