"""``adaptive``: Dryden et al.'s adaptive quantization (MLHPC@SC16, LBANN).

Parameters: ``proportion`` ``pi`` (integer >= 1, default 64), ``col_len``
(default None), ``samples`` (default ``8 pi``, at least that) and ``excess``
(default 4).

Columns: the vector is cut into columns of ``H`` contiguous elements, the last
one possibly shorter.  ``H = col_len`` when given, else from
``EncodeContext.shape``: its last axis when it has two or more dimensions,
otherwise :data:`~hpccomm.codecs.base.VECTOR_COLUMN` (4096) elements, so that a
1-D vector's chunks stay balanced across ranks.  ``H`` is clipped to
the vector's length and must stay below ``2**31``.  :meth:`Adaptive.align`
returns the column length, so that algorithms cut vectors between columns.

Per column ``c`` of ``h`` rows, for each sign separately (zeros belong to
neither; the negative side works on ``-v``):

1. Sample: a column with ``h > samples`` rows draws ``samples`` rows with
   replacement from the counter RNG (row ``hash_index(key, offset + start_c
   + j) % h`` for draw ``j``, ``key = stream_key(seed, rank, step, SALT)``,
   ``start_c`` the column's first element); shorter columns use every row
   (exact selection).  ``samples >= 8 pi`` keeps the threshold from being a
   sample maximum (ALGORITHMS.md section 3, pitfalls).
2. Threshold: with ``s`` sampled values of that sign, ``tau`` = the
   ``max(1, floor(s / pi))``-th largest of them; no sampled value of that sign
   means nothing of that sign is sent (LBANN's 2017 rule, not the paper-era
   ``tau = 0`` blow-up).
3. Selection ``{v >= tau}`` in the whole column, cut to at most
   ``cap(h) = min(h, excess * max(1, ceil(h / pi)))`` entries -- the largest
   ones, ties to lower rows (LBANN 2017 bounds a whole block by 4x its
   expected count; we bound every column and sign, so the bound is known from
   ``n`` alone).  The rest is not sent and stays in the residual.
4. Reconstruction: ``mu`` = the float64 mean of the entries actually sent,
   rounded to float32 (the paper's "mean of the selected tail"; using the sent
   entries exactly minimizes the squared error for that set).

Decoders write ``mu_pos`` / ``mu_neg`` at the listed rows and **zeros
everywhere else** of the column (``decode``), or add only the listed entries
(``decode_add``) -- never LBANN's "leave the rest as it was" (section 3
pitfall).

Wire layout (version 1), little-endian; ``W = ceil(n / H)`` columns::

    offset        size   field
    0             16     common header; extra = m (entries in all columns), n
    16            4      uint32 H (column length; 0 only when n = 0)
    20            12 W   per column c: uint32 count_c, float32 mu_pos_c,
                         float32 mu_neg_c  (0.0 for a sign with no entry)
    20 + 12 W     4 m    uint32 words (row << 1) | s, s = 1 positive, grouped
                         by column in column order, rows strictly increasing
                         within a column; sum of count_c = m

LBANN writes start offsets (so columns decode in parallel) and rows as
``pos << 1 | sign`` with ``pos`` linear in the block; we write counts (offsets
are their prefix sum) and rows relative to the column.  Size
``20 + 12 W + 4 m`` bytes: about ``32 / pi + 96 / H`` bits per element
(LBANN's ``32/pi + 96/H``).  A column holds at most ``min(h, 2 cap(h))``
entries.  Decoders reject ``m`` above that bound, an ``H`` that does not
fit, counts that do not add up to ``m``, more than ``cap(h)`` entries of one
sign in a column, and rows that are not strictly increasing inside a column,
before anything is written.
"""
from typing import Optional

import numpy as np

from ..errors import PacketError
from ..kernels import adaptive_slots as KA
from ..kernels import sparsify as K
from ..kernels.rng import stream_key
from .sparsifier import COUNT_MAX, WIDE_N, SparseCodec, check_count, index_dtype, payload_view
from .base import HEADER_SIZE, VECTOR_COLUMN, EncodeContext, register_codec

SALT = 0x61646170  # "adap"
PREFIX = HEADER_SIZE + 4
COLUMN_BYTES = 12
COLUMN = np.dtype([("count", "<u4"), ("mu_pos", "<f4"), ("mu_neg", "<f4")])


@register_codec
class Adaptive(SparseCodec):
    name = "adaptive"
    codec_id = 7
    stochastic = True

    def __init__(self, proportion: int = 64, col_len: Optional[int] = None,
                 samples: Optional[int] = None, excess: int = 4, nonfinite: str = "raise"):
        super().__init__(nonfinite=nonfinite)
        self.proportion = _positive_int("proportion", proportion)
        self.col_len = None if col_len is None else _positive_int("col_len", col_len)
        if self.col_len is not None and self.col_len >= WIDE_N:
            raise ValueError(f"adaptive: col_len must be below 2**31, not {col_len}")
        self.samples = 8 * self.proportion if samples is None else _positive_int("samples",
                                                                                  samples)
        if self.samples < 8 * self.proportion:
            raise ValueError(f"adaptive: samples must be >= 8 * proportion = "
                             f"{8 * self.proportion}, not {samples}")
        self.excess = _positive_int("excess", excess)

    def params(self):
        return {"proportion": self.proportion, "col_len": self.col_len,
                "samples": self.samples, "excess": self.excess}

    # -- columns -----------------------------------------------------------------
    def align(self, shape):
        if self.col_len is not None:
            return self.col_len
        if len(shape) >= 2:
            return max(1, int(shape[-1]))
        return VECTOR_COLUMN

    def column_length(self, n: int, shape: tuple) -> int:
        """``H`` for a vector of ``n`` elements encoded with ``shape``."""
        if n == 0:
            return 0
        return min(n, self.align(shape))

    def _column_max(self, h: int) -> int:
        return min(h, 2 * int(K.adaptive_cap(h, self.proportion, self.excess)))

    def max_count(self, n: int, H: int) -> int:
        """Largest ``m`` for ``n`` elements in columns of ``H``:
        ``min(h, 2 cap(h))`` per column."""
        if n == 0:
            return 0
        full, rest = divmod(n, H)
        return full * self._column_max(H) + (self._column_max(rest) if rest else 0)

    def max_wire_size(self, n):
        """With ``col_len`` set, the bound for that column length; otherwise
        (the column length comes from the shape at encode time) the worst case
        over all column lengths, ``H = 1``: ``20 + 16 n`` bytes."""
        if n == 0:
            return PREFIX
        H = 1 if self.col_len is None else min(n, self.col_len)
        return self._size(n, H, self.max_count(n, H))

    def capacity_for(self, n, shape):
        """The bound for the column length that ``n`` elements of a tensor
        of ``shape`` encode with (:meth:`column_length`; the owner's packet
        too): far below :meth:`max_wire_size`'s ``H = 1`` (4 KiB of a
        vector: 288 bytes a chunk, not 8212)."""
        if n == 0:
            return PREFIX
        H = self.column_length(n, shape)
        return self._size(n, H, self.max_count(n, H))

    @staticmethod
    def _size(n: int, H: int, m: int) -> int:
        W = -(-n // H) if n else 0
        return PREFIX + COLUMN_BYTES * W + 4 * m

    def _packet_size(self, packet, header):
        n, m = int(header["n"]), int(header["extra"])
        if packet.size < PREFIX:
            raise PacketError(f"{self.name}: packet of {packet.size} bytes is shorter than its "
                              f"{PREFIX} bytes of fixed fields")
        H = int(payload_view(packet, HEADER_SIZE, np.uint32, 1)[0])
        if n == 0:
            if H or m:
                raise PacketError(f"{self.name}: empty packet with H={H}, m={m}")
            return PREFIX
        if not 1 <= H <= min(n, WIDE_N - 1):
            raise PacketError(f"{self.name}: column length {H} for {n} elements")
        check_count(self, m, self.max_count(n, H), n)
        return self._size(n, H, m)

    # -- encode ------------------------------------------------------------------
    def _columns(self, n, ctx):
        H = self.column_length(n, ctx.shape)
        if H >= WIDE_N:
            raise ValueError(f"adaptive: a column of {H} elements is too long (< 2**31); "
                             "pass col_len")
        if self.max_count(n, H) > COUNT_MAX:
            raise ValueError(f"adaptive: {n} elements could need more than 2**32 - 1 entries; "
                             "reduce the tensor in smaller pieces")
        return H

    def _run(self, x, e, e_out, ctx):
        """``(H, counts, mu_pos, mu_neg, words, bad)`` of
        :func:`~hpccomm.kernels.sparsify.adaptive_encode` (``None`` for the
        arrays when ``n = 0``)."""
        n = x.size
        H = self._columns(n, ctx)
        if n == 0:
            return H, None, None, None, None, 0
        key = stream_key(ctx.seed, ctx.rank, ctx.step, SALT)
        return (H, *K.adaptive_encode(x, e, e_out, H, self.proportion, self.samples,
                                      self.excess, key, ctx.offset))

    def _packet(self, n, H, counts, mu_pos, mu_neg, words):
        if counts is None:
            return self.new_packet(PREFIX, 0)
        m, W = words.size, counts.size
        packet = self.new_packet(self._size(n, H, m), n, extra=m, zeroed=False)
        packet[HEADER_SIZE:PREFIX].view(np.uint32)[0] = H
        cols = packet[PREFIX:PREFIX + COLUMN_BYTES * W].view(COLUMN)
        cols["count"] = counts
        cols["mu_pos"] = mu_pos
        cols["mu_neg"] = mu_neg
        packet[PREFIX + COLUMN_BYTES * W:].view(np.uint32)[:] = words
        return packet

    def encode(self, x, ctx=EncodeContext()):
        """:meth:`Codec.encode`, the non-finite scan done by the encoder
        column by column (it reads each column before drawing from it
        anyway), not as a pass of its own."""
        x = self._check_input(x, scan=False)
        *parts, bad = self._run(x, None, None, ctx)
        self._raise_nonfinite(bad)
        return self._packet(x.size, *parts)

    def _encode(self, x, ctx):
        return self._packet(x.size, *self._run(x, None, None, ctx)[:5])

    def encode_with_feedback(self, x, e, e_out, ctx):
        """The packet of ``v = x + e`` (``v = x`` for ``e=None``) and ``e_out
        = v - decode(packet)`` in one pass over the columns
        (:func:`~hpccomm.kernels.sparsify.adaptive_encode`): each column's
        ``v`` is formed in ``e_out``, encoded while in cache, and corrected
        at its sent rows only (``v - 0.0 == v`` elsewhere) -- the bits of
        encode, decode and subtract."""
        x, e, e_out = self._feedback_arrays(x, e, e_out)
        *parts, bad = self._run(x, e, e_out, ctx)
        self._raise_nonfinite(bad)
        return self._packet(x.size, *parts)

    # -- the owner stage of twoshot -------------------------------------------------
    def owner_step(self, received, e, e_out, out, ctx):
        """The owner stage of ``twoshot``: every received packet validated
        (:meth:`_fields`) before anything is written; their entries added in
        rank order into ``out`` (zeroed: ``acc``); ``w = acc + e`` formed
        column by column in ``e_out`` and encoded while in cache, ``e_out``
        corrected at the sent rows (the kernel of :meth:`encode_with_feedback`;
        ``e_out=None``: no owner residual, ``w = acc`` encoded where it lies);
        then ``out = decode(packet)``.  The bits of decode-add, compensate,
        re-encode, decode and subtract, without their passes over the dense
        ``w``, its copy and the decoded chunk.  Returns the packet."""
        fields = [self._fields(packet, self.check_packet(packet, out)) for packet in received]
        out[:] = 0
        for f in fields:
            if f is not None:
                K.adaptive_scatter(*f, out, True)
        if e_out is None:
            *parts, bad = self._run(out, None, None, ctx)
        else:
            acc, e, e_out = self._feedback_arrays(out, e, e_out)
            *parts, bad = self._run(acc, e, e_out, ctx)
        self._raise_nonfinite(bad)
        packet = self._packet(out.size, *parts)
        if parts[1] is not None:        # n = 0 has nothing to decode
            K.adaptive_scatter(out.size, *parts, out, False)
        return packet

    # -- kernels on slots laid out once (hpccomm.kernels.adaptive_slots) ----------
    SLOT_STANDS_FOR = ("encode_with_feedback", "owner_step", "_decode_into", "_fields",
                       "_run", "_columns", "_packet", "_pairs", "column_length", "max_count",
                       "capacity_for", "draw_key")
    SLOT_RULE = "slot_entries"
    SLOT_DRAWS = True

    def slot_entries(self, n: int, shape=None):
        """The most words of a slot of ``n`` elements of a tensor of
        ``shape`` where the slot kernels apply: its columns in one group
        (:func:`~hpccomm.kernels.sparsify.adaptive_encode`'s, about
        :data:`~hpccomm.kernels.sparsify.BLOCK` elements)."""
        if shape is None:
            return None
        if n == 0:          # an empty chunk: the packet's fields alone
            return 0
        H = self.column_length(n, shape)
        if -(-n // H) > max(1, K.BLOCK // H) or H >= WIDE_N:
            return None
        return self.max_count(n, H)

    def draw_key(self, seed, rank, step):
        return stream_key(seed, rank, step, SALT)

    def slot_views(self, slot: np.ndarray, n: int, shape=None):
        """What the slot kernels take of ``slot`` (of :meth:`capacity_for`
        bytes), its header written but for the count: ``(slot as uint32, as
        float32, H, per-column scratch (counts, mu_pos, mu_neg), words
        scratch)``."""
        H = self.column_length(n, shape)
        W = -(-n // H) if n else 0
        self.bind_header(slot, n)
        slot[HEADER_SIZE:PREFIX] = 0
        return (slot.view(np.uint32), slot.view(np.float32), H, np.empty(W, np.int64),
                np.empty(W, np.float32), np.empty(W, np.float32),
                np.empty(self.max_count(n, H) + 1, np.uint32))

    def row_views(self, slots: np.ndarray, n=None, shape=None):
        """Received slots (rows of one uint8 array, or one slot) of ``n``
        elements as uint32 and float32 words, header included, and ``H``."""
        return slots.view(np.uint32), slots.view(np.float32), self.column_length(n, shape)

    def encode_slot(self, views, x, e, e_out, draw):
        """``encode_with_feedback`` of ``x`` (its stream: ``draw``) into the
        slot of ``views``; returns the NaN/Inf count (the slot then not
        written)."""
        su, sf, H, counts, mu_pos, mu_neg, words = views
        if x.size == 0:     # the fields as laid out: H = 0, no columns
            return 0
        return KA.encode_slot(x, x if e is None else e, e is not None, e_out, H, self.proportion,
                              self.samples, self.excess, draw.key, np.uint64(draw.offset),
                              counts, mu_pos, mu_neg, words, su, sf)

    def owner_slot(self, rows, k_in, e, e_out, out, views, draw):
        """:meth:`owner_step` from the received slots ``rows``
        (:meth:`row_views`, at most ``k_in`` words each) into the slot of
        ``views``: 0, or :data:`~hpccomm.kernels.adaptive_slots.BAD_PACKET`,
        or the NaN/Inf count (nothing sent written)."""
        su, sf, H, counts, mu_pos, mu_neg, words = views
        if out.size == 0:
            return 0 if not rows[0][:, [1, 4]].any() else KA.BAD_PACKET
        return KA.owner_slot(rows[0], rows[1], k_in, H, out if e is None else e, e is not None,
                             out if e_out is None else e_out, e_out is not None, out,
                             self.proportion, self.samples, self.excess, draw.key,
                             np.uint64(draw.offset), counts, mu_pos, mu_neg, words, su, sf)

    def decode_slot(self, row, k, out) -> bool:
        """``decode`` of a received slot (:meth:`row_views`) of at most ``k``
        words into ``out``; False (nothing written) when not valid."""
        if out.size == 0:
            return not row[0][[1, 4]].any()
        return KA.decode_slot(row[0], row[1], row[2], k, self.proportion, self.excess, out)

    # -- decode ------------------------------------------------------------------
    def _fields(self, packet, header):
        """``(n, H, counts, mu_pos, mu_neg, words)`` of a size-checked packet,
        validated (None for ``n = 0``)."""
        n, m = int(header["n"]), int(header["extra"])
        if n == 0:
            return None
        H = int(payload_view(packet, HEADER_SIZE, np.uint32, 1)[0])
        W = -(-n // H)
        cols = packet[PREFIX:PREFIX + COLUMN_BYTES * W].view(COLUMN)
        counts = np.ascontiguousarray(cols["count"])
        mu_pos = np.ascontiguousarray(cols["mu_pos"])
        mu_neg = np.ascontiguousarray(cols["mu_neg"])
        words = payload_view(packet, PREFIX + COLUMN_BYTES * W, np.uint32, m)
        if not K.adaptive_valid(n, H, counts, words, self.proportion, self.excess):
            raise PacketError(f"{self.name}: column counts or rows are inconsistent (counts must "
                              f"add up to {m}, rows increase inside each column, at most "
                              "cap(h) entries per sign)")
        return n, H, counts, mu_pos, mu_neg, words

    def _decode_into(self, packet, header, out, add):
        fields = self._fields(packet, header)
        if fields is not None:
            K.adaptive_scatter(*fields, out, add)

    def _pairs(self, x, ctx):
        n = x.size
        H, counts, mu_pos, mu_neg, words, _ = self._run(x, None, None, ctx)
        if counts is None:
            return np.empty(0, index_dtype(n)), np.empty(0, np.float32)
        column = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
        idx = (column * H + (words >> 1)).astype(index_dtype(n))
        vals = np.where(words & 1, mu_pos[column], mu_neg[column]).astype(np.float32)
        return idx, vals


def _positive_int(name, value) -> int:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"adaptive: {name} must be an integer >= 1, not {value!r}")
    return int(value)
