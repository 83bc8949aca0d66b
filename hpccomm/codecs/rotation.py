"""``rotate=True``: a randomized Hadamard rotation before a dense quantizer.

``hpccomm.get_codec("qsgd", bits=4, rotate=True)`` (or the name
``"qsgd+rotate"``; ``Allreducer(codec="qsgd", rotate=True)`` routes the option
the same way) wraps the quantizer ("the inner codec") in :class:`RotatedCodec`:
the vector is rotated by ``R = c H D`` block by block, the inner codec encodes
the rotated vector, and decoding un-rotates the inner codec's decode (THC,
SDP4Bit, QuaRot).  The rotation spreads an outlier over its whole block, so
a quantizer whose step follows the largest entry (``qsgd`` with
``norm="max"``, ``onebit``'s column means) loses less on heavy-tailed input;
on Gaussian input it changes nothing (a rotated Gaussian vector is Gaussian).

Options: ``rotate`` (bool) and ``rotate_block`` ``B``, a power of two in
``[2, 65536]`` (default :data:`DEFAULT_BLOCK`).  Accepted by every *dense*,
lossy codec (onebit, terngrad, qsgd, fp8, fp16, bf16); sparsifiers and
lossless codecs (``none``) refuse ``rotate=True`` with ``ValueError``, and
``rotate_block`` needs ``rotate=True``.  ``describe()`` / ``params()`` show
``rotate`` and ``rotate_block``, so ranks with other settings fail the
reducer's collective check.  The codec's ``name`` is the inner's with
``"+rotate"`` (``"qsgd+rotate"``): no device twin has that name, so the
device path stages the gradient to the host.

The rotation (:mod:`hpccomm.kernels.hadamard`): blocks of ``B`` elements
counted from the start of the encoded range, the trailing ``n mod B``
elements in the power-of-two pieces of its binary form, each piece ``v`` of
``s = 2**j`` elements sent as ``y = c_j H_s (d[:s] * v)`` -- ``H_s`` the
Sylvester-Hadamard matrix, ``c_j = float32(2**(-j/2))``, ``d`` one +-1
pattern of length ``B`` for every piece and every rank,
``d_i = -1`` iff bit 63 of ``hash_index(key, i)`` with ``key =
stream_key(seed, 0, step, 13)`` (the rank is not part of it: all ranks and
the owners of ``twoshot`` rotate a step alike, and a packet decodes without
knowing its offset).  Decode: ``v = d * (c_j H_s y)``.  No padding: the
packet holds as many elements as the input.

Layout (version 1), little-endian::

    offset  size  field
    0       16    common header: codec id 13, extra = k | inner_id << 8
                  (``B = 2**k``, 1 <= k <= 16; inner_id the inner codec's
                  id; other bits 0), n
    16      8     uint64 key of the signs ``d``
    24      rest  the inner codec's packet of the rotated vector (its own
                  header, the same n), 8-byte aligned

Wire size ``24 + inner size(n)`` bytes: 192 bits more than the inner codec
per packet.  Decoders check k, the inner codec id and the inner packet with
the inner codec's own checks (:meth:`~hpccomm.codecs.base.Codec.parse_header`
and its size rule) before any kernel runs; every key is valid.

Alignment: chunks of algorithms (:meth:`RotatedCodec.align`) and pipelined
segments (:meth:`RotatedCodec.segment_unit`) are cut at multiples of
``lcm(B, inner's unit)`` (None where the inner has None, or encodes its
pieces against a statistic of the whole chunk, as ``terngrad`` does), so a
chunk or segment rotates with the blocks of the whole vector.

Error feedback stays in the original domain (the residual memory holds
positions): :meth:`RotatedCodec.encode_with_feedback` gives the packet of
``v = x + e`` and ``e_out = v - decode(packet)`` with the bits of encode,
decode and subtract, in four passes (``y = R v``, written into ``e_out``,
no n-element temporary; the inner encode of ``y``; the inner decode into
``e_out``; ``e_out = v - R^T e_out``, re-reading ``x`` and ``e``).
``owner_step`` (``twoshot``'s owner) runs the separate steps: each received
packet decoded and un-rotated into the sum in rank order, ``w = acc + e``,
its packet, ``out = decode(packet)``, ``e_out = w - out`` --
what lets twoshot pipeline a rotated codec in segments.  Under error feedback
the inner codec's contractive scaling (``qsgd``, ``terngrad``) applies to the
rotated vector (``R`` is orthogonal: the same norms).

Not summable: the summable form's ``shared_scale`` and ``from_summable`` get
no step, so they cannot know the signs.  Non-finite input: ``"raise"``
raises with the count of the input's NaN/Inf; with ``"propagate"`` a
NaN/Inf makes its whole piece non-finite after the rotation.
"""
import functools
import math
import struct
from dataclasses import replace
from typing import Tuple

import numpy as np

from ..errors import NonFiniteError, PacketError
from ..kernels import hadamard as K
from ..kernels.rng import stream_key
from .base import HEADER_SIZE, RESERVED_IDS, Codec, EncodeContext

CODEC_ID = 13
assert RESERVED_IDS.get(CODEC_ID) == "rotate"
#: bytes before the inner packet: the common header and the key
PREFIX = HEADER_SIZE + 8
#: block sizes 2**K_MIN .. 2**K_MAX
K_MIN, K_MAX = 1, 16
#: the default block: 4 KiB of float32, in L1 while it is transformed; the
#: error of qsgd (max norm, bucket 512) and onebit on Student-t input is
#: about the same for 256 .. 4096 (tests/test_codec_rotation.py)
DEFAULT_BLOCK = 1024
_KEY = struct.Struct("<Q")
#: the options every codec name takes (:func:`hpccomm.codecs.get_codec`):
#: ``rotate=True`` wraps a dense quantizer in the rotation
ROTATE_OPTIONS = frozenset({"rotate", "rotate_block"})
#: suffix of a codec name that means ``rotate=True`` (``"qsgd+rotate"``)
ROTATE_SUFFIX = "+rotate"


def split_rotate(name: str) -> Tuple[str, bool]:
    """``("qsgd", True)`` for ``"qsgd+rotate"``, ``(name, False)`` otherwise."""
    if isinstance(name, str) and name.endswith(ROTATE_SUFFIX):
        return name[:-len(ROTATE_SUFFIX)], True
    return name, False


def _block_log2(block) -> int:
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1 \
            or block & (block - 1) or not K_MIN <= int(block).bit_length() - 1 <= K_MAX:
        raise ValueError(f"rotate_block must be a power of two in [{2 ** K_MIN}, "
                         f"{2 ** K_MAX}], not {block!r}")
    return int(block).bit_length() - 1


@functools.lru_cache(maxsize=16)
def _signs(key: int, k: int) -> np.ndarray:
    d = K.signs(np.uint64(key), 1 << k)
    d.flags.writeable = False
    return d


def rotated(codec: Codec, rotate=True, block=None) -> Codec:
    """``codec`` wrapped in the rotation (``rotate=True``), or ``codec``
    itself (``rotate=False`` without ``rotate_block``); ``ValueError`` for
    a codec that cannot be rotated or bad options."""
    if not isinstance(rotate, (bool, np.bool_)):
        raise ValueError(f"rotate must be True or False, not {rotate!r}")
    if not rotate:
        if block is not None:
            raise ValueError("rotate_block needs rotate=True")
        return codec
    return RotatedCodec(codec, DEFAULT_BLOCK if block is None else block)


class RotatedCodec(Codec):
    """A dense lossy ``inner`` codec behind the Hadamard rotation in blocks of
    ``block`` elements (see the module docstring)."""

    codec_id = CODEC_ID
    dense = True
    summable = False
    summable_when = ("summable only with rotate=False (its summable form gets no step, which "
                     "the rotation's signs need)")

    def __init__(self, inner: Codec, block: int = DEFAULT_BLOCK):
        if not isinstance(inner, Codec):
            raise TypeError(f"rotate: the inner codec must be a Codec, not {type(inner).__name__}")
        if isinstance(inner, RotatedCodec):
            raise ValueError(f"rotate: {inner.name!r} is already rotated")
        if not inner.dense or inner.lossless or inner.algorithm is not None \
                or inner.elementwise_bound:
            why = ("lossless" if inner.lossless
                   else "reduced by an algorithm of its own" if inner.algorithm is not None
                   else "bounded per element, which a rotation would void"
                   if inner.elementwise_bound else "not a dense quantizer")
            raise ValueError(f"rotate=True needs a dense lossy codec (onebit, terngrad, qsgd, "
                             f"fp8, fp16, bf16); {inner.name!r} is {why}")
        super().__init__(nonfinite=inner.nonfinite)
        self.k = _block_log2(block)
        self.block = 1 << self.k
        self.inner = inner
        self.name = inner.name + ROTATE_SUFFIX
        self.rotate = True
        self.rotate_block = self.block
        self.stochastic = inner.stochastic
        self.biased = inner.biased
        self.fixed_size = inner.fixed_size
        self.input_dtypes = inner.input_dtypes
        self._extra = self.k | inner.codec_id << 8

    def params(self):
        return {**self.inner.params(), "rotate": True, "rotate_block": self.block}

    def check_tolerance(self, nranks, error_feedback):
        return self.inner.check_tolerance(nranks, error_feedback)

    # -- alignment and sizes ---------------------------------------------------
    def align(self, shape):
        return math.lcm(self.block, int(self.inner.align(shape)))

    def segment_unit(self, shape):
        # an inner codec whose pieces share their chunk's statistic is not cut:
        # the rotation has no piece-wise form of that protocol
        unit = None if self.inner.chunk_statistic else self.inner.segment_unit(shape)
        return None if unit is None else math.lcm(self.block, int(unit))

    def wire_size(self, n):
        size = self.inner.wire_size(n)
        return None if size is None else PREFIX + size

    def wire_size_for(self, n, shape):
        size = self.inner.wire_size_for(n, shape)
        return None if size is None else PREFIX + size

    def max_wire_size(self, n):
        return PREFIX + self.inner.max_wire_size(n)

    def capacity_for(self, n, shape):
        size = self.inner.capacity_for(n, shape)
        return None if size is None else PREFIX + size

    def _fields(self, header):
        """``k`` from a header's ``extra``, validated with the inner id."""
        extra = int(header["extra"])
        k, inner_id = extra & 0xFF, extra >> 8
        if not K_MIN <= k <= K_MAX:
            raise PacketError(f"{self.name}: block field k = {k} is outside [{K_MIN}, {K_MAX}]")
        if inner_id != self.inner.codec_id:
            raise PacketError(f"{self.name}: the packet wraps codec id {inner_id}, expected "
                              f"{self.inner.codec_id} ({self.inner.name})")
        return k

    def _inner_header(self, packet, n):
        sub = packet[PREFIX:]
        return sub, self.inner.parse_header(sub, n)

    def _packet_size(self, packet, header):
        self._fields(header)
        if packet.size < PREFIX:
            raise PacketError(f"{self.name}: packet of {packet.size} bytes is shorter than its "
                              f"{PREFIX} bytes of header and key")
        sub, inner_header = self._inner_header(packet, int(header["n"]))
        return PREFIX + self.inner._packet_size(sub, inner_header)

    # -- encode ------------------------------------------------------------------
    def _key(self, ctx):
        return int(stream_key(ctx.seed, 0, ctx.step, CODEC_ID))

    def _rotate(self, x, e, ctx, y=None):
        """``(y, key)``: ``y = R (x + e)`` (into ``y`` where given); raises for
        non-finite input under ``nonfinite="raise"``, and for a rotation that
        overflows."""
        key = self._key(ctx)
        if y is None:
            y = np.empty(x.size, dtype=np.float32)
        bad_in, bad_out = K.rotate(x, x if e is None else e, e is not None,
                                   _signs(key, self.k), self.block, y)
        self._raise_nonfinite(bad_in)
        if bad_out and self.nonfinite == "raise":
            raise NonFiniteError(f"{self.name}: the rotation overflows float32 at {bad_out} "
                                 "value(s) (entries near the float32 maximum)")
        return y, key

    def _inner_ctx(self, ctx):
        # the rotated vector was checked (or the policy propagates); its
        # fresh part would need rotating too, and no dense codec reads it
        return replace(ctx, finite=True, fresh=None)

    def _wrap(self, inner_packet, n, key):
        packet = self.new_packet(PREFIX + inner_packet.size, n, extra=self._extra, zeroed=False)
        _KEY.pack_into(packet, HEADER_SIZE, key)
        packet[PREFIX:] = inner_packet
        return packet

    def _encode(self, x, ctx):
        y, key = self._rotate(x, None, ctx)
        return self._wrap(self.inner.encode(y, self._inner_ctx(ctx)), x.size, key)

    def encode_with_feedback(self, x, e, e_out, ctx=EncodeContext()):
        """The packet of ``v = x + e`` (``v = x`` for ``e=None``) and ``e_out
        = v - decode(packet)``, with the bits of encode, decode and subtract:
        ``y = R v`` (one pass over ``x``, ``e``), the inner encode of ``y``,
        the inner decode into ``e_out``, ``e_out = v - R^T e_out`` (a pass
        over ``x``, ``e``, ``e_out``)."""
        x, e, e_out = self._feedback_arrays(x, e, e_out)
        # y = R v goes to e_out, whose old contents nothing reads, unless it
        # overlaps x or e (re-read by the last step): no fresh n-element array
        spare = not (np.may_share_memory(e_out, x)
                     or (e is not None and np.may_share_memory(e_out, e)))
        y, key = self._rotate(x, e, ctx, e_out if spare else None)
        inner_packet = self.inner.encode(y, self._inner_ctx(ctx))
        self.inner.decode(inner_packet, e_out)
        K.unrotate_residual(x, x if e is None else e, e is not None, e_out,
                            _signs(key, self.k), self.block, e_out)
        return self._wrap(inner_packet, x.size, key)

    def owner_step(self, received, e, e_out, out, ctx):
        """The owner stage of ``twoshot`` as its separate steps: the decoded
        received packets summed in rank order (each un-rotated into the sum),
        ``w = acc + e`` (``e`` used only with ``e_out``), its packet,
        ``out = decode(packet)`` and ``e_out = w - out``.  Returns the packet."""
        m = out.size
        acc = np.zeros(m, dtype=np.float32)
        for packet in received:
            self.decode_add(packet, acc)
        w = acc if e_out is None or e is None else acc + e
        packet = self.reencode(w, ctx)
        self.decode(packet, out)
        if e_out is not None:
            np.subtract(w, out, out=e_out)
        return packet

    # -- decode ------------------------------------------------------------------
    def _decode_into(self, packet, header, out, add):
        k = self._fields(header)
        sub, inner_header = self._inner_header(packet, out.size)
        (key,) = _KEY.unpack_from(packet, HEADER_SIZE)
        q = np.empty(out.size, dtype=np.float32) if add else out
        self.inner._decode_into(sub, inner_header, q, False)
        K.unrotate(q, _signs(key, k), 1 << k, out, add)
