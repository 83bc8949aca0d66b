"""``randk``: ``k`` uniformly random elements, the same on every rank.

Parameters: ``ratio`` (default 0.01) and ``unbiased`` (default True).  A
vector of ``n > 0`` elements sends ``k = max(1, ceil(ratio * n))`` values
(:func:`~hpccomm.codecs.sparsifier.fraction_count`), so the packet size depends
on ``n`` only: ``fixed_size = True``.

Indices: a uniformly random ``k``-subset of ``[0, n)``, sorted, drawn by
Floyd's algorithm (:func:`hpccomm.kernels.sparsify.floyd_indices`) under the
64-bit *index key*
``hash_index(stream_key(seed, 0, step, SALT), offset)`` -- the rank is left
out, so every rank picks the same indices at the same step and the packets
add up value by value; ``offset`` (a chunk's global start) gives every chunk
of a vector its own pattern.  The key travels in the packet and the decoder
regenerates the indices from it.

Scaling: ``unbiased=True`` multiplies the sent values by ``n / k`` (as a
float32), so ``E[decode(encode(x))] = x`` over the random subsets; the codec
is then unbiased and error feedback defaults off.  ``unbiased=False`` sends
the values as they are: a biased codec, error feedback on by default.

Error feedback (``EncodeContext.feedback``) needs a contractive compressor:
the scaled values would leave ``x_i (1 - n / k)`` in the residual of a sent
element, which grows without bound.  Random-k scaled by ``n / k`` has the
variance factor ``omega = n / k - 1``, and its contractive form ``C / (1 +
omega)`` (Stich et al. 2018) is the unscaled values: under feedback the
codec sends the values as they are, ``unbiased`` or not (``E||C/(1+omega) -
x||**2 = (1 - k / n) ||x||**2``).  So does the summable form.

Wire layout (version 1), little-endian::

    offset  size   field
    0       16     common header; extra = k, n
    16      8      uint64 index key
    24      4 k    float32 values (already scaled) at the k indices, ascending

Size ``24 + 4 k`` bytes: ``32 k / n`` bits per element plus ``192 / n``.
Decoders check ``extra == k(n)``.

Owner stage of ``twoshot`` (:meth:`reencode`): the owner's sum of decoded
chunks is zero off the shared indices, so it is sent exactly there, without a
second ``n / k`` scaling -- lossless, no owner residual.

Fused kernels (:mod:`hpccomm.kernels.randk`): ``encode_with_feedback`` (one
pass: ``v = x + e``, the NaN/Inf count, ``e_out``; then the ``k`` values)
and ``owner_step`` (the rank-order sum of the packets at the ``k`` shared
indices, then one pass over the chunk for ``w = 0 + e``, ``e_out`` and
``out``; a packet of another key is decoded where its key says, as
:meth:`decode` does), and both on packets laid out once (``payload_views``,
``encode_views``, ``owner_views``, ``decode_views``), which ``twoshot``'s plan
of a repeated small call runs.  Each kernel regenerates the indices from
the key.  The numpy steps above (``encode``, ``decode``, ``reencode``) stay
the reference they are tested against.

Summable form: the indices are shared, so the values sum position by
position.  ``shared_scale`` is None; ``to_summable`` is a float32 vector of
``k + 9`` entries::

    [0, k)       the (scaled) values, as in the packet
    k            1.0                     -> the sum is the number of ranks P
    k+1 .. k+8   the 8 bytes of the index key, little-endian, as 0.0 .. 255.0

``summable_dtype`` is float32.  ``from_summable`` reads ``P`` and the key
bytes back (``sum / P``: exact integers as long as ``255 P < 2**24``, i.e.
``P <= 65793``, checked), regenerates the indices and scatters the summed values
(zeros elsewhere).  The side band costs 36 bytes per call; ranks that disagree
on seed or step almost always leave non-integer key bytes, which raise
PacketError.
"""
import numpy as np

from ..errors import PacketError
from ..kernels import randk as F
from ..kernels import sparsify as K
from ..kernels.rng import hash_index_cpu, stream_key
from .sparsifier import check_fraction, index_dtype, payload_view
from .base import HEADER_SIZE, Codec, EncodeContext, payload_rows, register_codec
from .topk import top_count

SALT = 0x72616E64  # "rand"
PREFIX = HEADER_SIZE + 8
#: entries after the values in the summable form: rank counter + 8 key bytes
SIDE = 9
#: largest rank count whose key-byte sums (<= 255 P) stay exact in float32
MAX_RANKS = (2 ** 24 - 1) // 255


def index_stream(seed: int, step: int) -> np.uint64:
    """The rank-independent stream of one call's index keys."""
    return stream_key(seed, 0, step, SALT)


def index_key(seed: int, step: int, offset: int) -> np.uint64:
    """The rank-independent key the indices of the chunk at ``offset`` are drawn from."""
    return hash_index_cpu(index_stream(seed, step), np.uint64(offset))


def random_indices(key: np.uint64, n: int, k: int) -> np.ndarray:
    """The ``k`` sorted indices of ``[0, n)`` that ``key`` selects."""
    idx = np.empty(k, dtype=index_dtype(n))
    K.floyd_indices(np.uint64(key), n, idx)
    return idx


@register_codec
class RandK(Codec):
    name = "randk"
    codec_id = 9
    stochastic = True
    summable = True

    def __init__(self, ratio: float = 0.01, unbiased: bool = True, nonfinite: str = "raise"):
        super().__init__(nonfinite=nonfinite)
        self.ratio = check_fraction("ratio", ratio)
        self.unbiased = bool(unbiased)
        self.biased = not self.unbiased

    def params(self):
        return {"ratio": self.ratio, "unbiased": self.unbiased}

    def check_tolerance(self, nranks, error_feedback):
        if not self.unbiased:
            return 2.0
        # unbiased scaling by n / k: relative error ~ sqrt(n / k - 1); margin 3x
        return 3.0 * (1.0 / self.ratio) ** 0.5

    def count(self, n: int) -> int:
        return top_count(self.ratio, n)

    def wire_size(self, n):
        return PREFIX + 4 * self.count(n)

    def _payload_size(self, header):
        n = int(header["n"])
        if int(header["extra"]) != self.count(n):
            raise PacketError(f"{self.name}: packet announces {int(header['extra'])} values, "
                              f"{n} elements take {self.count(n)}")
        return self.wire_size(n)

    # -- selection -------------------------------------------------------------
    def _values(self, x, ctx):
        """``(key, idx, values)`` of one call, values scaled when unbiased
        (and not under error feedback: see the module docstring)."""
        n = x.size
        k = self.count(n)
        key = index_key(ctx.seed, ctx.step, ctx.offset)
        idx = random_indices(key, n, k)
        vals = x[idx]
        if self.unbiased and k and not ctx.feedback:
            vals *= np.float32(n / k)
        return key, idx, vals

    def sparsify(self, x, ctx=EncodeContext()):
        """``(indices, values)``: the entries ``decode(encode(x, ctx))`` sets."""
        _, idx, vals = self._values(self._check_input(x), ctx)
        return idx, vals

    def _encode(self, x, ctx):
        n = x.size
        key, _, vals = self._values(x, ctx)
        packet = self.new_packet(self.wire_size(n), n, extra=vals.size)
        packet[HEADER_SIZE:PREFIX].view(np.uint64)[0] = key
        packet[PREFIX:].view(np.float32)[:] = vals
        return packet

    def reencode(self, x, ctx=EncodeContext()):
        """A sum of decoded packets of the same step and offset is zero off the
        shared indices: send its values there, unscaled (lossless).  Without
        this, ``twoshot``'s owner stage would scale the already scaled sum by
        ``n / k`` a second time."""
        x = self._check_input(x)
        n = x.size
        key = index_key(ctx.seed, ctx.step, ctx.offset)
        vals = x[random_indices(key, n, self.count(n))]
        packet = self.new_packet(self.wire_size(n), n, extra=vals.size)
        packet[HEADER_SIZE:PREFIX].view(np.uint64)[0] = key
        packet[PREFIX:].view(np.float32)[:] = vals
        return packet

    def _decode_into(self, packet, header, out, add):
        n, k = int(header["n"]), int(header["extra"])
        key = payload_view(packet, HEADER_SIZE, np.uint64, 1)[0]
        vals = payload_view(packet, PREFIX, np.float32, k)
        if not add:
            out[:] = 0
        K.scatter(out, random_indices(key, n, k), vals, add)

    # -- fused kernels, also on packets laid out once (see Codec.bind_packet) --
    def draw_key(self, seed, rank, step):
        """The call's index stream: the rank is left out, so that every rank
        (and every owner) draws the same indices."""
        return index_stream(seed, step)

    def header_extra(self, n, shape):
        return self.count(n)

    def payload_views(self, packet, n, shape):
        """``(key words, values)``: the index key as two uint32 and the ``k``
        float32 values of a packet of ``n`` elements."""
        return (packet[HEADER_SIZE:PREFIX].view(np.uint32),
                packet[PREFIX:PREFIX + 4 * self.count(n)].view(np.float32))

    def payload_row_views(self, packets, m, shape):
        """``(key words, values)`` of the packets of one chunk of ``m``, as rows."""
        return (payload_rows(packets, HEADER_SIZE, np.uint32, 2),
                payload_rows(packets, PREFIX, np.float32, self.count(m)))

    def _encode_fields(self, views, x, e, e_out, draw, count):
        """The kernel of :meth:`encode_with_feedback` into ``views``: scaled
        when unbiased and not under ``draw.feedback``; ``e_out`` written when
        given.  Returns the NaN/Inf count (0 without ``count``)."""
        key_words, vals = views
        k = vals.size
        scaled = self.unbiased and k > 0 and not draw.feedback
        return F.randk_encode(x, e, draw.key, draw.offset,
                              np.float32(x.size / k if scaled else 1.0), scaled, count,
                              key_words, vals, e_out)

    def encode_views(self, views, x, e, e_out, draw):
        """:meth:`encode_with_feedback` into ``views`` as ``draw``; the residual
        only under ``draw.feedback``."""
        return self._encode_fields(views, x, e, e_out if draw.feedback else None, draw,
                                   self.nonfinite == "raise")

    def owner_views(self, rows, e, e_out, out, views, draw):
        """:meth:`owner_step` from the received ``rows`` into ``views`` as ``draw``."""
        key_words, vals = views
        return F.randk_owner(rows[0], rows[1], e, draw.key, draw.offset, key_words, vals,
                             e_out, out)

    @staticmethod
    def decode_views(views, out, add):
        F.randk_decode(views[0], views[1], out, add)

    def encode_with_feedback(self, x, e, e_out, ctx):
        """The packet of ``v = x + e`` (``v = x`` for ``e=None``) and ``e_out =
        v - decode(packet)`` in one pass over ``v``
        (:func:`~hpccomm.kernels.randk.randk_encode`); the bits of encode,
        decode and subtract."""
        x, e, e_out = self._feedback_arrays(x, e, e_out)
        packet, views = self.new_bound_packet(x.size, ctx.shape)
        count = self.nonfinite == "raise" and not (ctx.finite and e is None)
        self._raise_nonfinite(self._encode_fields(views, x, e, e_out, self.draw(ctx), count))
        return packet

    def owner_step(self, received, e, e_out, out, ctx):
        """The owner stage of ``twoshot`` in one kernel
        (:func:`~hpccomm.kernels.randk.randk_owner`): the rank-order sum of
        the received packets, ``w = acc + e`` (``e=None``: no
        residual yet), the owner packet of ``w`` (:meth:`reencode`), ``e_out
        = w - decode(packet)`` (``e_out=None``: no owner residual) and ``out
        = decode(packet)``.  The bits of decode-add, compensate, re-encode,
        decode and subtract.  Returns the packet."""
        m = out.size
        for packet in received:
            self.check_packet(packet, out)
        out, e, e_out = self._feedback_arrays(out, e, e_out)
        packet, views = self.new_bound_packet(m, ctx.shape)
        self._raise_nonfinite(self.owner_views(self.payload_row_views(received, m, ctx.shape),
                                               e, e_out, out, views, self.draw(ctx)))
        return packet

    # -- summable form -------------------------------------------------------------
    def shared_scale(self, x):
        return None

    def to_summable(self, x, scale, ctx):
        key, _, vals = self._values(self._check_input(x), ctx)
        side = np.empty(SIDE, dtype=np.float32)
        side[0] = 1
        side[1:] = np.array([key], dtype="<u8").view(np.uint8)
        return np.concatenate([vals, side])

    def summable_dtype(self, nranks):
        return np.dtype(np.float32)

    def from_summable(self, total, scale, out, add=False):
        n = out.size
        k = self.count(n)
        if total.size != k + SIDE:
            raise PacketError(f"{self.name}: summable vector of {total.size} entries, {n} "
                              f"elements take {k + SIDE}")
        side = np.asarray(total[k:], dtype=np.float64)
        ranks = side[0]
        if not (1 <= ranks <= MAX_RANKS and ranks == np.round(ranks)):
            raise PacketError(f"{self.name}: the rank counter of the summable vector is "
                              f"{ranks!r}, not an integer in [1, {MAX_RANKS}]")
        key_bytes = side[1:] / ranks
        if not np.all((key_bytes == np.round(key_bytes)) & (key_bytes >= 0) & (key_bytes <= 255)):
            raise PacketError(f"{self.name}: the ranks' index keys differ (different seeds or "
                              "steps?) or the summable vector is corrupt")
        key = key_bytes.astype(np.uint8).view("<u8")[0]
        vals = np.ascontiguousarray(total[:k], dtype=np.float32)
        if not add:
            out[:] = 0
        K.scatter(out, random_indices(key, n, k), vals, add)
        return out
