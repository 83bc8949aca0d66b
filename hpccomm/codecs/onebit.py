"""``onebit``: 1-bit SGD (Seide et al., Interspeech 2014; CNTK), zero threshold.

Each element is sent as its sign bit; each *column* -- a run of ``H``
consecutive elements of the flat vector, the last one possibly shorter --
ships two float32 reconstruction values::

    mu_pos = mean of the column's entries >= 0     (0 if there are none)
    mu_neg = mean of the column's entries <  0     (0 if there are none)
    bit_i  = 1 iff x_i >= 0;   decode: mu_pos if bit_i else mu_neg

The means are float64 sums divided by the count and rounded once to float32
(:func:`hpccomm.kernels.onebit.onebit_encode`), so a constant column
decodes exactly.  The estimator is biased: ``biased = True`` turns error
feedback on by default (the paper's central point).

Column length ``H``: the ``col_len`` parameter, or with ``col_len=None`` the
last axis of ``EncodeContext.shape`` when it has two or more axes, else
:data:`~hpccomm.codecs.base.VECTOR_COLUMN` (4096) elements, so that a 1-D
vector's chunks stay balanced across ranks.  The ``H`` used is written into the packet, so decoding needs
no parameter; it is stored clamped to ``[1, max(n, 1)]`` (a longer column is
the same single column).  :meth:`OneBitCodec.align` returns ``H`` so that
chunked algorithms cut at column boundaries.

Layout (version 1), little-endian::

    offset         size            field
    0              16              common header: codec id 3, extra = H, n
    16             8 C             per column c (C = ceil(n / H)), at 16 + 8 c:
                                   float32 mu_pos, float32 mu_neg
    16 + 8 C       4 ceil(n / 32)  sign bits: uint32 words, element i at bit
                                   i mod 32 of word i // 32 (LSB first);
                                   unused high bits of the last word are 0

Wire size ``16 + 8 ceil(n / H) + 4 ceil(n / 32)`` bytes, about
``1 + 64 / H`` bits per element.  The bit order is sequential, as in LBANN's
port -- not CNTK's strided (GPU-coalescing) order, where bit ``k`` of word
``w`` holds row ``w + k W``; CNTK also pads every column to whole words.

Since the size depends on ``H``, a codec with ``col_len=None`` does not know
its size from ``n`` alone: such instances have ``fixed_size = False`` and
``wire_size(n)`` is None unless a ``shape`` is passed.
"""

import numpy as np

from ..errors import PacketError
from ..kernels import onebit as K
from ..kernels import threads
from .base import HEADER_SIZE, VECTOR_COLUMN, Codec, payload_rows, register_codec

#: largest column length the header's uint32 field holds
COL_LEN_MAX = 2**32 - 1


def packet_size(n: int, col_len: int) -> int:
    """Bytes of a packet of ``n`` elements in columns of ``col_len``."""
    return HEADER_SIZE + 8 * (-(-n // col_len)) + 4 * (-(-n // 32))


def _tile_columns(n: int, col_len: int) -> int:
    """Columns per tile when the kernels should run on several threads (at
    least two tiles and more than one thread), else 0.  Either way the bits
    are the same (:func:`~hpccomm.kernels.onebit.onebit_tile_columns`)."""
    if n < 2 * K.TILE or threads.get() == 1:
        return 0
    cols = K.onebit_tile_columns(col_len)
    if -(-n // col_len) <= cols:
        return 0
    threads.use()
    return cols


@register_codec
class OneBitCodec(Codec):
    name = "onebit"
    dense = True
    codec_id = 3
    biased = True

    def __init__(self, col_len=None, nonfinite: str = "raise"):
        super().__init__(nonfinite=nonfinite)
        if col_len is not None:
            if isinstance(col_len, bool) or not isinstance(col_len, (int, np.integer)) \
                    or not 1 <= col_len <= COL_LEN_MAX:
                raise ValueError(f"onebit: col_len must be None or an integer in "
                                 f"[1, {COL_LEN_MAX}], not {col_len!r}")
            col_len = int(col_len)
        self.col_len = col_len
        #: with col_len=None the size depends on the tensor's shape
        self.fixed_size = col_len is not None

    def params(self):
        return {"col_len": self.col_len}

    def column_length(self, shape: tuple = (), n: int = None) -> int:
        """The column length for a tensor of ``shape`` (before clamping to
        the encoded length): ``col_len``, else ``shape[-1]`` for two or more
        axes, else :data:`~hpccomm.codecs.base.VECTOR_COLUMN`."""
        if self.col_len is not None:
            return self.col_len
        if len(shape) >= 2:
            return max(int(shape[-1]), 1)
        return VECTOR_COLUMN

    def align(self, shape):
        return self.column_length(shape)

    def segment_unit(self, shape):
        # columns are independent: chunks cut at column boundaries
        return self.column_length(shape)

    def wire_size(self, n, shape=None):
        """``16 + 8 ceil(n / H) + 4 ceil(n / 32)``; with ``col_len=None`` the
        column length comes from ``shape`` and the size is None without it."""
        if self.col_len is None and shape is None:
            return None
        return packet_size(n, self.column_length(shape or (), n))

    def wire_size_for(self, n, shape):
        return self.wire_size(n, shape)

    def max_wire_size(self, n):
        """Exact with ``col_len``; otherwise the bound for ``H = 1``."""
        return packet_size(n, self.col_len or 1)

    def _payload_size(self, header):
        n, col_len = int(header["n"]), int(header["extra"])
        if not 1 <= col_len <= max(n, 1):
            raise PacketError(f"onebit: column length {col_len} is outside [1, {max(n, 1)}] "
                              f"for n = {n}")
        return packet_size(n, col_len)

    def _encode(self, x, ctx):
        n = x.size
        packet, (col_len, means, words) = self.new_bound_packet(n, ctx.shape)
        tiles = _tile_columns(n, col_len)
        if tiles:
            K.onebit_encode_tiles(x, x, False, False, col_len, means, words, x, None, tiles)
        else:
            K.onebit_encode(x, col_len, means, words)
        return packet

    def encode_with_feedback(self, x, e, e_out, ctx):
        """The packet of ``v = x + e`` (``v = x`` for ``e=None``) and
        ``e_out = v - decode(packet)``, in one pass
        (:func:`~hpccomm.kernels.onebit.onebit_encode_feedback`); the bits
        of encode, decode and subtract.  ``x``, ``e``, ``e_out``: float32,
        contiguous, of one length."""
        x, e, e_out = self._feedback_arrays(x, e, e_out)
        packet, views = self.new_bound_packet(x.size, ctx.shape)
        self._raise_nonfinite(self.encode_views(views, x, e, e_out))
        return packet

    def owner_step(self, received, e, e_out, out, ctx):
        """The owner stage of ``twoshot`` in two passes over the chunk:
        ``acc = sum of decode(received[src])`` in rank order into ``out``
        (:func:`~hpccomm.kernels.onebit.onebit_decode_sum`), then ``w = acc +
        e`` into ``e_out``, its packet, ``e_out = w - decode(packet)``
        (``e_out=None``: no owner residual) and ``out = decode(packet)``
        (:func:`~hpccomm.kernels.onebit.onebit_owner_step`; ``out`` is read
        before it is overwritten).
        The bits of decode-add, compensate, re-encode, decode and subtract.
        Returns the packet."""
        m = out.size
        cols = None
        for packet in received:
            col_len = int(self.check_packet(packet, out)["extra"])
            if cols is None:
                cols = col_len
            elif col_len != cols:
                raise PacketError(f"{self.name}: packets of one chunk with column lengths "
                                  f"{cols} and {col_len}")
        packet, views = self.new_bound_packet(m, ctx.shape)
        self._raise_nonfinite(self.owner_views(self._row_views(received, m, cols), e, e_out, out,
                                               views))
        return packet

    def _decode_into(self, packet, header, out, add):
        self.decode_views(self._views(packet, out.size, int(header["extra"])), out, add)

    # -- the kernels on laid-out packets (see Codec.bind_packet) --------------
    def header_extra(self, n, shape):
        """The column length written into the header: ``H`` clamped to ``[1, max(n, 1)]``."""
        return min(self.column_length(shape, n), max(n, 1))

    @staticmethod
    def _views(packet, n, col_len):
        ncols = -(-n // col_len)
        return (col_len, packet[HEADER_SIZE:HEADER_SIZE + 8 * ncols].view(np.float32),
                packet[HEADER_SIZE + 8 * ncols:].view(np.uint32))

    def payload_views(self, packet, n, shape):
        """``(H, means, words)``: the column length, the per-column means and
        the sign words of a packet of ``n`` elements."""
        return self._views(packet, n, self.header_extra(n, shape))

    @staticmethod
    def _row_views(packets, m, cols):
        ncols = -(-m // cols) if m else 0
        return (max(cols, 1), payload_rows(packets, HEADER_SIZE, np.float32, 2 * ncols),
                payload_rows(packets, HEADER_SIZE + 8 * ncols, np.uint32, -(-m // 32)))

    def payload_row_views(self, packets, m, shape):
        """``(H, means, words)`` of the packets of one chunk of ``m``, as rows."""
        return self._row_views(packets, m, self.header_extra(m, shape))

    @staticmethod
    def encode_views(views, x, e, e_out, draw=None):
        col_len, means, words = views
        tiles = _tile_columns(x.size, col_len)
        if tiles:
            return K.onebit_encode_tiles(x, x if e is None else e, e is not None, True, col_len,
                                         means, words, e_out, None, tiles)
        return K.onebit_encode_feedback(x, x if e is None else e, e is not None,
                                        col_len, means, words, e_out)

    @staticmethod
    def owner_views(rows, e, e_out, out, views, draw=None):
        m = out.size
        cols, rmeans, rwords = rows
        tiles = _tile_columns(m, cols)
        if tiles:
            K.onebit_decode_sum_tiles(rmeans, rwords, cols, out, tiles)
        else:
            K.onebit_decode_sum(rmeans, rwords, cols, out)
        col_len, pm, pw = views
        args = (out, out if e is None else e, e is not None, e_out is not None, col_len, pm, pw,
                out if e_out is None else e_out, out)
        tiles = _tile_columns(m, col_len)
        return K.onebit_encode_tiles(*args, tiles) if tiles else K.onebit_owner_step(*args)

    @staticmethod
    def decode_views(views, out, add):
        col_len, means, words = views
        tiles = _tile_columns(out.size, col_len)
        if tiles:
            K.onebit_decode_tiles(words, means, col_len, out, add, tiles)
        else:
            K.onebit_decode(words, means, col_len, out, add)
