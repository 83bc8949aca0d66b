"""``terngrad``: TernGrad (Wen et al., NeurIPS 2017), stochastic ternary codes.

For the encoded vector ``x`` (a whole tensor, or one chunk of it):

1. clipping threshold: ``sigma`` = population standard deviation of ``x``
   (float64), ``s = float32(min(max|x|, clip * sigma))``; with ``clip=None``,
   or when ``sigma == 0`` (constant input, which then stays exact),
   ``s = float32(max|x|)``.  Entries are clipped to ``[-s, s]``, so ``s`` is
   also ``max |clipped x|``, the per-tensor scaler of the paper;
2. ternarize: ``t_i = sign(x_i)`` if ``u_i * s < min(|x_i|, s)`` else 0, in
   float32, with ``u_i = uniform01(key, offset + i)`` and
   ``key = stream_key(seed, rank, step, 4)`` -- so ``E[t_i s] = clip(x_i)``:
   unbiased apart from clipping (and the ``2**-24`` resolution of ``u``);
3. decode: ``s * t_i``.

``s = 0`` (all-zero input) gives all-zero codes and exact zeros.  With
``nonfinite="propagate"`` a NaN or Inf makes ``s`` NaN and the whole vector
decodes to NaN.

Layout (version 1), little-endian::

    offset  size          field
    0       16            common header: codec id 4, extra = 0, n
    16      4             float32 s
    20      ceil(n / 4)   2-bit codes, element i at bits 2 (i mod 4) .. +1 of
                          byte 20 + i // 4: 0b00 = 0, 0b01 = +1, 0b11 = -1
                          (two's complement; 0b10 is never written and
                          decodes as -2); unused bits of the last byte are 0

Wire size ``20 + ceil(n / 4)`` bytes: 2 bits per element plus 160 bits
(the layout of ``qsgd`` with ``bits=2``, one bucket; the reference code packs
four contiguous quarters instead of consecutive elements).

Error feedback (``EncodeContext.feedback``; off by default: the codec is
unbiased) needs a contractive compressor.  TernGrad of ``v`` at the scale
``M = max|v|`` has ``E||T(v) - v||**2 = M ||v||_1 - ||v||**2``, the variance
factor ``omega = M ||v||_1 / ||v||**2 - 1`` of this very ``v``.  Under
feedback ``clip`` does not apply (``s = M``) and the packet stores ``s' =
float32(s / (1 + omega)) = float32(s ||v||**2 / (M ||v||_1))`` (``||v||_1``
and ``||v||**2`` from the moments' pass,
:func:`~hpccomm.kernels.terngrad.tern_stats`; ``s`` itself when ``v`` is all
zeros or not finite): the codes are drawn against ``s`` as above, every
kept element decodes to ``+-s'``, and ``T(v) / (1 + omega)`` is contractive,
``E||T/(1+omega) - v||**2 = omega / (1 + omega) ||v||**2`` (Stich et al.
2018, Karimireddy et al. 2019), so the residual ``v - decode`` stays
bounded: 3.9 ``||g||`` on a repeated Gaussian (measured).  Clipped, an
element above ``s`` could send at most ``s'`` per step and the residual
grew as ``sqrt(t)``.  For a Gaussian of ``10**5`` elements (``M`` about 4.4
sigma) ``s' / s`` is about 0.28.  The layout is unchanged; the summable form
has no such scaling (one shared scale for all ranks), and ``summable``
refuses error feedback with ``terngrad``.

Summable form (algorithm ``summable``): ``shared_scale(x)`` is ``[s]``, which
the algorithm MAX-reduces; ``to_summable`` ternarizes against the shared
scale ``S`` -- entries clipped at this rank's own ``s``, kept with
probability ``min(|x_i|, s) / S`` -- as int8 codes; sums over ``P`` ranks
fit int8 while ``P <= 127`` (int16 up to 32767, else int32), and
``from_summable`` returns ``float32(total * S)``.
"""
import math

import numpy as np

from ..errors import PacketError
from ..kernels import bitcodes
from ..kernels import terngrad as K
from ..kernels.rng import stream_key
from .summable_codes import check_no_feedback, check_total, scale_array, summed_code_dtype
from .base import HEADER_SIZE, Codec, float32_rows, payload_rows, register_codec

#: payload offset: header + the float32 scale
CODES_OFFSET = HEADER_SIZE + 4


@register_codec
class TernGradCodec(Codec):
    name = "terngrad"
    dense = True
    codec_id = 4
    stochastic = True
    #: pieces of a chunk share the chunk's scale (twoshot pipelines it in two phases)
    chunk_statistic = True
    summable = True
    summable_feedback = False

    def __init__(self, clip=2.5, nonfinite: str = "raise"):
        super().__init__(nonfinite=nonfinite)
        if clip is not None:
            if isinstance(clip, bool) or not isinstance(clip, (int, float)) \
                    or not (math.isfinite(clip) and clip > 0):
                raise ValueError(f"terngrad: clip must be None or a positive number, "
                                 f"not {clip!r}")
            clip = float(clip)
        self.clip = clip

    def params(self):
        return {"clip": self.clip}

    def check_tolerance(self, nranks, error_feedback):
        # unbiased; the ternary variance of a Gaussian clipped at 2.5 sigma gives a
        # relative error of ~1.5 per stage (measured), and twoshot has two stages
        return 4.0

    def wire_size(self, n):
        return CODES_OFFSET + (-(-n // 4))

    def _payload_size(self, header):
        if int(header["extra"]) != 0:
            raise PacketError(f"terngrad: header field 'extra' must be 0, "
                              f"not {int(header['extra'])}")
        return self.wire_size(int(header["n"]))

    def scale(self, x: np.ndarray) -> np.float32:
        """The clipping threshold and scaler ``s`` of ``x`` (see above)."""
        # e=None given, not left out: numba compiles an omitted argument apart
        maxabs, s1, s2, _, _, _ = K.tern_stats(x, None)
        return self._scale_from(x.size, maxabs, s1, s2)

    @staticmethod
    def _unit(s, maxabs, l1, l2, ctx) -> np.float32:
        """The scale the packet stores: ``s``, or under error feedback
        ``float32(s * ||v||**2 / (max|v| ||v||_1))`` (see above)."""
        if not ctx.feedback or not (maxabs > 0 and math.isfinite(l1) and l1 > 0
                                    and math.isfinite(l2)):
            return s
        return np.float32(float(s) * min(1.0, l2 / (float(maxabs) * l1)))

    def _scale_from(self, n, maxabs, s1, s2, ctx=None) -> np.float32:
        """``s`` from the moments of :func:`~hpccomm.kernels.terngrad.tern_stats`
        (unclipped under error feedback, ``ctx.feedback``)."""
        if not (math.isfinite(s1) and math.isfinite(s2)):
            return np.float32(np.nan)
        s = float(maxabs)
        if self.clip is not None and n and not (ctx is not None and ctx.feedback):
            sigma = math.sqrt(max(s2 / n - (s1 / n) ** 2, 0.0))
            if sigma > 0:
                s = min(s, self.clip * sigma)
        return np.float32(s)

    def _key(self, ctx):
        return self.draw_key(ctx.seed, ctx.rank, ctx.step)

    def _new_packet(self, n, s):
        """A packet for ``n`` codes with the scale ``s`` filled in, and its
        code bytes (every one is written by the kernels)."""
        packet = self.new_packet(self.wire_size(n), n, zeroed=False)
        packet[HEADER_SIZE:CODES_OFFSET].view(np.float32)[0] = s
        return packet, packet[CODES_OFFSET:]

    def segment_unit(self, shape):
        # pieces share their chunk's scale (``chunk_statistic``); cut at whole
        # blocks, so that the owner's moments add up in the order of one piece
        return K.BLOCK

    def chunk_stat(self, x, e, ctx):
        """``(s, unit)`` of ``v = x + e`` (``v = x`` for ``e=None``): the
        clipping scale and the scale the packets store (see above), from one
        pass (:func:`~hpccomm.kernels.terngrad.tern_stats`)."""
        s, unit, bad = self._stat_or_bad(x.size, K.tern_stats(x, e), ctx)
        self._raise_nonfinite(bad)
        return s, unit

    def encode_piece(self, x, e, e_out, stat, ctx):
        """The packet of ``v = x + e`` drawn against its chunk's ``stat``
        (:meth:`chunk_stat`), ``ctx.offset`` the piece's start; with ``e_out``,
        ``e_out = v - decode(packet)``: codes, residual and pack block by
        block (:func:`~hpccomm.kernels.terngrad.tern_encode`)."""
        s, unit = stat
        packet, codes = self._new_packet(x.size, unit)
        K.tern_encode(x, e, self._key(ctx), ctx.offset, s, s, unit, codes, e_out, None)
        return packet

    def _encode(self, x, ctx):
        return self.encode_piece(x, None, None, self.chunk_stat(x, None, ctx), ctx)

    def encode_with_feedback(self, x, e, e_out, ctx):
        """The packet of ``v = x + e`` (``v = x`` for ``e=None``) and ``e_out =
        v - decode(packet)``, in two passes (the scale needs all of ``v``):
        :meth:`chunk_stat`, then :meth:`encode_piece`.  The bits of encode,
        decode and subtract."""
        x, e, e_out = self._feedback_arrays(x, e, e_out)
        return self.encode_piece(x, e, e_out, self.chunk_stat(x, e, ctx), ctx)

    # -- the owner stage of twoshot, whole or in pieces ----------------------
    def owner_begin(self):
        """The running moments of one owner chunk (:meth:`owner_add`)."""
        return K.owner_accumulator()

    def owner_add(self, received, e, out, lo, hi, acc):
        """Pass 1 over the piece ``[lo, hi)`` of the owner's chunk (``out`` and
        ``e`` the whole chunk; pieces in order): the rank-order sum of the
        received packets of the piece into ``out[lo:hi]`` and the moments of
        ``w = out + e`` into ``acc``
        (:func:`~hpccomm.kernels.terngrad.tern_owner_add`)."""
        for packet in received:
            self.check_packet(packet, out[lo:hi])
        scales = payload_rows(received, HEADER_SIZE, np.float32, 1)
        rows = payload_rows(received, CODES_OFFSET, np.uint8, -(-(hi - lo) // 4))
        K.tern_owner_add(rows, scales, e, out, lo, hi, *acc)

    def owner_stat(self, acc, e, out, ctx):
        """``(s, unit)`` of the owner's ``w = out + e`` once every piece was added."""
        s, unit, bad = self._stat_or_bad(out.size, K.tern_owner_total(*acc, e, out), ctx)
        self._raise_nonfinite(bad)
        return s, unit

    def owner_encode_piece(self, e, e_out, out, lo, hi, stat, ctx):
        """The owner packet of the piece ``[lo, hi)`` of ``w = out + e`` against
        the chunk's ``stat`` (``ctx.offset`` the piece's start), ``e_out = w -
        decode(packet)`` (``e_out=None``: no owner residual) and ``out =
        decode(packet)`` over the piece."""
        s, unit = stat
        packet, codes = self._new_packet(hi - lo, unit)
        K.tern_encode(out[lo:hi], None if e is None else e[lo:hi], self._key(ctx), ctx.offset,
                      s, s, unit, codes, None if e_out is None else e_out[lo:hi], out[lo:hi])
        return packet

    def owner_step(self, received, e, e_out, out, ctx):
        """The owner stage of ``twoshot`` in two passes over the chunk: the
        rank-order sum of the received packets into ``out`` and the moments
        of ``w = acc + e`` (:meth:`owner_add`), then the packet of ``w``,
        ``e_out = w - decode(packet)`` (``e_out=None``: no owner residual,
        ``w = acc``) and ``out = decode(packet)`` (:meth:`owner_encode_piece`).
        The bits of decode-add, compensate, re-encode, decode and subtract.
        Returns the packet."""
        e = None if e_out is None else e
        acc = self.owner_begin()
        self.owner_add(received, e, out, 0, out.size, acc)
        stat = self.owner_stat(acc, e, out, ctx)
        return self.owner_encode_piece(e, e_out, out, 0, out.size, stat, ctx)

    def _decode_into(self, packet, header, out, add):
        self.decode_views(self.payload_views(packet, out.size, None), out, add)

    # -- the kernels on laid-out packets (see Codec.bind_packet) --------------
    def draw_key(self, seed, rank, step):
        return stream_key(seed, rank, step, TernGradCodec.codec_id)

    @staticmethod
    def payload_views(packet, n, shape):
        """``(scale, codes)``: the stored scale (one float32) and the
        ``ceil(n / 4)`` code bytes of a packet of ``n`` elements."""
        return (packet[HEADER_SIZE:CODES_OFFSET].view(np.float32),
                packet[CODES_OFFSET:CODES_OFFSET + -(-n // 4)])

    @staticmethod
    def payload_row_views(packets, m, shape):
        """``(scale bytes, codes)`` of the packets of one chunk of ``m``, as
        rows (the scales as their 4 bytes: packets ``20 + ceil(m / 4)``
        bytes apart leave them unaligned for a float32 view)."""
        return (payload_rows(packets, HEADER_SIZE, np.uint8, 4),
                payload_rows(packets, CODES_OFFSET, np.uint8, -(-m // 4)))

    def _stat_or_bad(self, n, moments, ctx):
        """``(s, unit, bad)`` from the moments of
        :func:`~hpccomm.kernels.terngrad.tern_stats` (or the owner's total) of
        ``n`` values, under ``ctx.feedback`` (an :class:`EncodeContext` or a
        :class:`~hpccomm.codecs.base.Draw`); ``s`` and ``unit`` None when a
        NaN/Inf is to be raised rather than encoded."""
        maxabs, s1, s2, l1, l2, bad = moments
        if bad and self.nonfinite == "raise":
            return None, None, bad
        s = self._scale_from(n, maxabs, s1, s2, ctx)
        return s, self._unit(s, maxabs, l1, l2, ctx), bad

    def encode_views(self, views, x, e, e_out, draw):
        """:meth:`encode_with_feedback` into ``views`` as ``draw`` (the moments'
        pass, then codes and residual; the residual only under
        ``draw.feedback``)."""
        s, unit, bad = self._stat_or_bad(x.size, K.tern_stats(x, e), draw)
        if s is not None:
            scale, codes = views
            scale[0] = unit
            K.tern_encode(x, e, draw.key, draw.offset, s, s, unit, codes,
                          e_out if draw.feedback else None, None)
        return bad

    def owner_views(self, rows, e, e_out, out, views, draw):
        """:meth:`owner_step` from the received ``rows`` into ``views`` as
        ``draw``: the rank-order sum and the moments of ``w = acc + e``, then
        the codes, ``e_out`` and ``out = decode(packet)``."""
        e = None if e_out is None else e
        scale_bytes, codes = rows
        scales = float32_rows(scale_bytes)
        acc = K.owner_accumulator()
        K.tern_owner_add(codes, scales, e, out, 0, out.size, *acc)
        s, unit, bad = self._stat_or_bad(out.size, K.tern_owner_total(*acc, e, out), draw)
        if s is not None:
            scale, own = views
            scale[0] = unit
            K.tern_encode(out, e, draw.key, draw.offset, s, s, unit, own, e_out, out)
        return bad

    @staticmethod
    def decode_views(views, out, add):
        scale, codes = views
        bitcodes.codes_decode(codes, 2, max(out.size, 1), 1, scale, out, add)

    # -- summable form -------------------------------------------------------
    def shared_scale(self, x):
        return np.array([self.scale(self._check_input(x))], dtype=np.float32)

    def to_summable(self, x, scale, ctx):
        check_no_feedback(self, ctx)
        x = self._check_input(x)
        shared = scale_array(scale, 1, self.name)[0]
        codes = np.empty(x.size, dtype=np.int8)
        K.tern_codes(x, self._key(ctx), ctx.offset, shared, self.scale(x), codes)
        return codes

    def summable_dtype(self, nranks):
        return summed_code_dtype(int(nranks))

    def from_summable(self, total, scale, out, add=False):
        scales = scale_array(scale, 1, self.name)
        check_total(total, out, self.name)
        bitcodes.summed_decode(total, max(out.size, 1), 1, scales, out, add)
        return out

