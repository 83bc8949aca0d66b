"""``qsgd``: QSGD (Alistarh et al., NeurIPS 2017), fixed-width ("b-bit") codes,
or with ``elias=True`` the paper's variable-length Elias coding of the same codes.

Parameters: ``bits`` in {2, 4, 8} (``L = 2**(bits - 1) - 1`` levels: 1, 7,
127), ``bucket`` size ``d`` (default 512), ``norm`` ``"l2"`` (default) or
``"max"`` and ``elias`` (a bool, default False: the layout below).
Buckets are consecutive runs of ``d`` elements of the encoded vector, the
last one possibly shorter.  Per bucket ``j``:

1. scale ``S_j``: the l2 norm (float64 sum of squares, rounded once; a finite
   norm beyond the float32 range saturates to its maximum) or ``max |x|``;
2. code ``q_i = sign(x_i) * min(floor(a_i + u_i), L)`` with
   ``a_i = |x_i| * (L / S_j)`` in float64 and
   ``u_i = uniform01(key, offset + i)``, ``key = stream_key(seed, rank,
   step, 5)``: level ``floor(a_i) + 1`` with probability ``a_i - floor(a_i)``,
   so ``E[q_i S_j / L] = x_i`` -- unbiased (to the ``2**-24`` resolution of
   ``u``).  A bucket with ``S_j = 0`` (all zeros) or a non-finite scale gets
   zero codes; with ``nonfinite="propagate"`` such a bucket decodes to NaN;
3. decode: ``float32(q_i * (float64(S_j) / L))``.

Layout (version 1), little-endian::

    offset      size              field
    0           16                common header: codec id 5, n, and
                                  extra = d | bits << 28  (d < 2**28)
    16          4 B               float32 S_j per bucket, B = ceil(n / d)
    16 + 4 B    ceil(n bits / 8)  codes: element i at bits (i bits) mod 8 ..
                                  of byte 16 + 4 B + (i bits) // 8, LSB first,
                                  ``bits``-bit two's complement in [-L, L]
                                  (-L - 1 is never written and decodes as
                                  such); unused bits of the last byte are 0

Wire size ``16 + 4 ceil(n / d) + ceil(n bits / 8)`` bytes: ``bits + 32 / d``
bits per element plus 128 (4.0625 for 4 bits, d = 512).  ``d`` is stored
clamped to ``[1, max(n, 1)]`` (a longer bucket is the same single bucket);
decoders reject other values and any bit width but 2, 4, 8.  The norm is
not needed to decode and is not stored.

Elias coding (``elias=True``, layout version 2): the same scales and codes
-- the same random numbers, the same contraction under error feedback --
coded losslessly as in the paper's Elias coding: per bucket the float32
scale, then for each non-zero code in index order the Elias-omega code of
its gap (``i - p``, ``p`` the previous non-zero's index in the bucket, -1
at first: gaps are >= 1), one sign bit (1: negative) and the Elias-omega
code of its level ``|q_i|`` (:mod:`hpccomm.kernels.elias`).  A packet
decodes to the very float32 values of the fixed-width packet of the same
input and context.  Layout (version 2), little-endian::

    offset       size   field
    0            16     common header: codec id 5, version 2, n,
                        extra = d | bits << 28 (as version 1)
    16           8      uint64 S: bytes of the bucket streams
    24           4 B    float32 S_j per bucket, B = ceil(n / d)
    24 + 4 B     4 B    uint32 T_j: bits of bucket j's stream
    24 + 8 B     S      the bucket streams, bucket j from byte
                        sum_{k<j} ceil(T_k / 8): bits MSB first (bit t of
                        a stream is bit 7 - t mod 8 of its byte t // 8),
                        its last byte padded with zero bits

Wire size ``24 + 8 B + S`` bytes with ``S = sum ceil(T_j / 8)``: per
element ``8 S / n + 64 / d`` bits plus 192 -- the paper's 32 bits of scale
per bucket, 32 bits of the table ``T`` (which lets buckets be found without
decoding the ones before, and a packet be validated in one read of its
bits) and under 8 bits of byte padding per bucket.  A bucket of ``h``
elements takes at most ``T = h (2 + |omega(L)|)`` bits (every element at
level ``L``; ``|omega(L)|`` = 1, 6, 13 bits for 2, 4, 8 bits): that is
:meth:`QSGDCodec.max_wire_size` -- 3, 8 and 15 bits per element, above the
fixed width.  The size depends on the data (``fixed_size`` is False,
``wire_size`` None).

On Gaussian input with the l2 norm and ``d = 512`` a packet takes 0.52,
1.61 and 6.44 bits per element at 2, 4 and 8 bits (fixed width: 2.06, 4.06,
8.06), within the paper's bound on the expected size ``(3 + 3/2
log2(2 (s**2 + d) / (s (s + sqrt d)))) s (s + sqrt d) + 32`` per bucket
(0.58, 2.76 and a vacuous 156 per element); with ``s = sqrt(d)`` (8 bits,
``d = 16129``) 2.76 against the paper's ``2.8 d + 32``.  Under the max norm
most codes are non-zero and Elias coding loses at 4 and 8 bits (4.22 and
12.0 bits per element): use it with the l2 norm or at 2 bits.

Passes over memory: encode (and its fused forms) is the fixed-width
kernel's pass into scratch codes (``bits / 8`` bytes per element), then one
read of those codes that writes the streams and ``T_j`` into a scratch of
the worst case (only its written pages are touched) and a copy of the ``S``
stream bytes into the packet; decode reads the streams once into int8 codes
(``n`` bytes), then one pass writes ``out``.  The kernels run on one
thread; buckets are independent (the table gives each one's place), so a
parallel form would give the same bytes.

Decoders check, before ``out`` is touched: the header's ``S`` against the
packet's size, every ``T_j`` against its worst case and their padded sum
against ``S``, and in every bucket that each code ends inside its ``T_j``
bits, that gaps stay inside the bucket and levels in ``[1, L]``, that the
last code ends exactly at ``T_j`` and that the padding is zero.  The coding
is canonical: a packet that passes decodes to codes whose coding is that
very packet.  A ``qsgd`` instance decodes its own version only (a
fixed-width packet sent to an Elias codec fails on the version, and the
reverse).  Elias coding is CPU work: the device twin refuses it and the
device path stages such a call through the host.

Error feedback (``EncodeContext.feedback``; off by default: the codec is
unbiased) needs a contractive compressor.  A bucket's variance factor
``omega_j`` (``E||Q(x) - x||**2 <= omega_j ||x||**2``) is at most ``omega(d)
= min(d / L**2, sqrt(d) / L)`` for ``d`` elements (Alistarh et al., Lemma
3.1; with ``norm="max"`` too, ``max|x| <= ||x||``), and at most ``S_j
||x_j||_1 / (L ||x_j||**2)`` for the bucket's own values (each element's
variance ``(S/L)**2 p (1 - p)`` is at most ``(S/L) |x_i|``: ``p <= a_i``).
Under feedback the packet stores ``float32(S_j / (1 + omega_j))`` with
``omega_j`` the smaller of the two (``d``: the bucket's own length, the last
one possibly shorter; the sums in float64 lanes right after the scale's,
from cache; ``S_j`` itself when it is 0 or not finite): the codes are drawn
against ``S_j`` as above and decode to ``Q(x) / (1 + omega_j)``, which is
contractive (``E||Q/(1+omega) - x||**2 <= omega / (1 + omega) ||x||**2``;
Stich et al. 2018, Karimireddy et al. 2019), so the residual ``v - decode``
stays bounded.  For a Gaussian bucket of 512 the factor is about 0.28 at 4
bits (l2 norm) and at 2 bits (max norm), where ``omega(512)`` alone gives
0.24 and 0.04.  The layout is unchanged; only the stored scales are
smaller.  The summable form has no such scaling (one shared scale for all
ranks): ``summable`` refuses error feedback with ``qsgd``.

Summable form (algorithm ``summable``): ``shared_scale(x)`` gives the ``B``
bucket scales, which the algorithm MAX-reduces; ``to_summable`` quantizes
against them (``a_i <= L`` since every rank's scale is at most the shared
one) to int8 codes; sums over ``P`` ranks need ``P L`` in range: int8 while
``P L <= 127``, int16 while ``<= 32767``, else int32.  It sends integer
codes, not Elias-coded ones: an ``elias=True`` instance is not summable
(algorithm ``summable`` refuses it).
"""
import math

import numpy as np

from ..errors import PacketError
from ..kernels import elias as E
from ..kernels import bitcodes
from ..kernels import qsgd as K
from ..kernels.rng import stream_key
from .summable_codes import check_no_feedback, check_total, scale_array, summed_code_dtype
from .base import HEADER_SIZE, Codec, float32_rows, payload_rows, register_codec

BITS = (2, 4, 8)
NORMS = ("l2", "max")
#: bucket sizes fit the low 28 bits of the header's ``extra`` field
BUCKET_MAX = 2**28 - 1
#: layout versions: fixed-width codes, Elias coding
FIXED_VERSION, ELIAS_VERSION = 1, 2
#: bytes before the scales of an Elias packet: the header and the uint64 S
ELIAS_PREFIX = HEADER_SIZE + 8


def packet_size(n: int, bits: int, bucket: int) -> int:
    """Bytes of a fixed-width packet of ``n`` elements (not Elias)."""
    return HEADER_SIZE + 4 * (-(-n // bucket)) + (-(-(n * bits) // 8))


def elias_worst_bits(levels: int) -> int:
    """Most bits per element of an Elias bucket stream: ``2 + |omega(L)|``."""
    return 2 + int(E.omega_length(levels))


_OMEGA = {}


def omega_tables():
    """The codewords and lengths of the Elias-omega codes of ``1 ..
    E.TABLE - 1`` (built on first use)."""
    if "encode" not in _OMEGA:
        codes = np.empty(E.TABLE, dtype=np.uint32)
        lengths = np.empty(E.TABLE, dtype=np.uint8)
        E.omega_table(codes, lengths)
        _OMEGA["encode"] = codes, lengths
    return _OMEGA["encode"]


def _aligned(a: np.ndarray) -> np.ndarray:
    """``a``, or a copy of it when its data is not aligned to its items (a
    packet received at an odd offset)."""
    return a if a.ctypes.data % a.itemsize == 0 else a.copy()


@register_codec
class QSGDCodec(Codec):
    name = "qsgd"
    dense = True
    codec_id = 5
    stochastic = True
    summable = True
    summable_feedback = False

    def __init__(self, bits: int = 4, bucket: int = 512, norm: str = "l2",
                 elias: bool = False, nonfinite: str = "raise"):
        super().__init__(nonfinite=nonfinite)
        if isinstance(bits, bool) or bits not in BITS:
            raise ValueError(f"qsgd: bits must be one of {BITS}, not {bits!r}")
        if isinstance(bucket, bool) or not isinstance(bucket, (int, np.integer)) \
                or not 1 <= bucket <= BUCKET_MAX:
            raise ValueError(f"qsgd: bucket must be an integer in [1, {BUCKET_MAX}], "
                             f"not {bucket!r}")
        if norm not in NORMS:
            raise ValueError(f"qsgd: norm must be one of {NORMS}, not {norm!r}")
        if not isinstance(elias, (bool, np.bool_)):
            raise ValueError(f"qsgd: elias must be True or False, not {elias!r}")
        self.bits, self.bucket, self.norm = int(bits), int(bucket), norm
        #: quantization levels L
        self.levels = 2 ** (self.bits - 1) - 1
        #: Elias coding (layout version 2) instead of fixed-width codes
        self.elias = bool(elias)
        if self.elias:
            self.version = ELIAS_VERSION
            self.fixed_size = False
            self.summable = False
            self.summable_when = ("summable only with elias=False (the summed form sends "
                                  "integer codes, not Elias-coded ones)")

    def params(self):
        p = {"bits": self.bits, "bucket": self.bucket, "norm": self.norm}
        if self.elias:
            p["elias"] = True
        return p

    def check_tolerance(self, nranks, error_feedback):
        # QSGD's variance bound min(d / s**2, sqrt(d) / s) (Alistarh et al., Lemma 3.1)
        # per stage, two stages in twoshot, and a factor 2 of margin
        d, s = self.bucket, self.levels
        return 2.0 * math.sqrt(2.0 * min(d / s ** 2, math.sqrt(d) / s)) + 0.5

    def _bucket(self, n):
        """The bucket size of a packet of ``n`` elements."""
        return min(self.bucket, max(n, 1))

    def wire_size(self, n):
        if self.elias:
            return None
        return packet_size(n, self.bits, self._bucket(n))

    def max_wire_size(self, n):
        """The fixed size, or with ``elias`` the worst case: every bucket at
        ``2 + |omega(L)|`` bits per element, rounded up to whole bytes."""
        if not self.elias:
            return self.wire_size(n)
        bucket = self._bucket(n)
        full, rest = divmod(n, bucket)
        w = elias_worst_bits(self.levels)
        stream = full * (-(-bucket * w // 8)) + (-(-rest * w // 8))
        return ELIAS_PREFIX + 8 * (-(-n // bucket)) + stream

    def segment_unit(self, shape):
        # buckets count from the chunk's start and draws from the global index
        return self.bucket

    @staticmethod
    def _fields(header):
        """``(bits, bucket)`` from a header's ``extra``, validated."""
        n, extra = int(header["n"]), int(header["extra"])
        bits, bucket = extra >> 28, extra & BUCKET_MAX
        if bits not in BITS:
            raise PacketError(f"qsgd: bit width {bits} is not one of {BITS}")
        if not 1 <= bucket <= max(n, 1):
            raise PacketError(f"qsgd: bucket size {bucket} is outside [1, {max(n, 1)}] "
                              f"for n = {n}")
        return bits, bucket

    def _payload_size(self, header):
        bits, bucket = self._fields(header)
        return packet_size(int(header["n"]), bits, bucket)

    def _packet_size(self, packet, header):
        if not self.elias:
            return self._payload_size(header)
        bits, bucket = self._fields(header)
        if packet.size < ELIAS_PREFIX:
            raise PacketError(f"qsgd: Elias packet of {packet.size} bytes is shorter than its "
                              f"{ELIAS_PREFIX} bytes of fixed fields")
        stream = int(packet[HEADER_SIZE:ELIAS_PREFIX].view("<u8")[0])
        return ELIAS_PREFIX + 8 * (-(-int(header["n"]) // bucket)) + stream

    def _key(self, ctx):
        return self.draw_key(ctx.seed, ctx.rank, ctx.step)

    def omega(self, d: int) -> float:
        """The variance factor ``min(d / L**2, sqrt(d) / L)`` of a bucket of ``d``."""
        L = self.levels
        return min(d / L ** 2, math.sqrt(d) / L)

    def _contract(self, n, bucket, ctx):
        """The kernels' ``(contract, omega, omega_last)``: under error
        feedback, :meth:`omega` of the full buckets and of the last one."""
        if not ctx.feedback or n == 0:
            return False, 0.0, 0.0
        last = n - (-(-n // bucket) - 1) * bucket
        return True, self.omega(bucket), self.omega(last)

    def _new_packet(self, n):
        """``(packet, scales, codes, bucket)`` for ``n`` elements: the packet
        with its header, views of its scale and code fields (every byte is
        written by the kernels) and the bucket size it uses.  With ``elias``
        the packet is None and the fields are scratch arrays, which
        :meth:`_elias_packet` codes."""
        if self.elias:
            bucket = self._bucket(n)
            return (None, np.empty(-(-n // bucket), dtype=np.float32),
                    np.empty(-(-(n * self.bits) // 8), dtype=np.uint8), bucket)
        packet = self.new_packet(self.wire_size(n), n, extra=self.header_extra(n, None),
                                 zeroed=False)
        return (packet, *self.payload_views(packet, n, None))

    def _finish(self, packet, scales, codes, bucket, n):
        """The packet of the fields :meth:`_new_packet` gave and the
        kernels filled: ``packet`` itself, or with ``elias`` the Elias packet
        of ``scales`` and ``codes``."""
        return packet if packet is not None else self._elias_packet(n, bucket, scales, codes)

    def _elias_packet(self, n, bucket, scales, codes):
        """The Elias packet (layout version 2) of the fixed-width ``codes``
        and the ``scales``: the streams in one pass over the codes
        (:func:`~hpccomm.kernels.elias.elias_encode`) into a scratch of the
        worst case (only the pages written are touched), then copied after
        the header, scales and table."""
        nb = scales.size
        table = np.empty(nb, dtype=np.uint32)
        words, lengths = omega_tables()
        head = ELIAS_PREFIX + 8 * nb
        scratch = np.empty(self.max_wire_size(n) - head, dtype=np.uint8)
        nbytes = int(E.elias_encode(codes, self.bits, bucket, n, words, lengths, table, scratch))
        packet = self.new_packet(head + nbytes, n, extra=self.header_extra(n, None),
                                 zeroed=False)
        packet[HEADER_SIZE:ELIAS_PREFIX].view("<u8")[0] = nbytes
        packet[ELIAS_PREFIX:ELIAS_PREFIX + 4 * nb] = scales.view(np.uint8)
        packet[ELIAS_PREFIX + 4 * nb:head] = table.view(np.uint8)
        packet[head:] = scratch[:nbytes]
        return packet

    def _elias_codes(self, packet, header, n):
        """``(scales, codes, bits, bucket)`` of a checked Elias packet: its
        scales and its integer codes (int8, ``n``), after validating every
        bucket's bits (:func:`~hpccomm.kernels.elias.elias_decode`); raises
        PacketError for a malformed one."""
        bits, bucket = self._fields(header)
        nb = -(-n // bucket)
        head = ELIAS_PREFIX + 8 * nb
        scales = _aligned(packet[ELIAS_PREFIX:ELIAS_PREFIX + 4 * nb].view(np.float32))
        table = _aligned(packet[ELIAS_PREFIX + 4 * nb:head].view(np.uint32))
        levels = 2 ** (bits - 1) - 1
        codes = np.empty(n, dtype=np.int8)
        err, j = E.elias_decode(packet[head:], table, bucket, n, levels,
                                elias_worst_bits(levels), codes)
        if err:
            where = "" if j < 0 else f" (bucket {j})"
            raise PacketError(f"qsgd: malformed Elias packet: {E.ERRORS[int(err)]}{where}")
        return scales, codes, bits, bucket

    def _encode(self, x, ctx):
        packet, scales, codes, bucket = self._new_packet(x.size)
        K.qsgd_encode(x, bucket, self.bits, self.levels, self.norm == "max", self._key(ctx),
                      ctx.offset, scales, codes, *self._contract(x.size, bucket, ctx))
        return self._finish(packet, scales, codes, bucket, x.size)

    def encode_with_feedback(self, x, e, e_out, ctx):
        """The packet of ``v = x + e`` (``v = x`` for ``e=None``) and ``e_out =
        v - decode(packet)``, reading ``x`` and ``e`` once, bucket by bucket
        (:func:`~hpccomm.kernels.qsgd.qsgd_encode_feedback`); the bits of
        encode, decode and subtract."""
        x, e, e_out = self._feedback_arrays(x, e, e_out)
        packet, scales, codes, bucket = self._new_packet(x.size)
        self._raise_nonfinite(self.encode_views((scales, codes, bucket), x, e, e_out,
                                                self.draw(ctx)))
        return self._finish(packet, scales, codes, bucket, x.size)

    def owner_step(self, received, e, e_out, out, ctx):
        """The owner stage of ``twoshot`` in one pass over the chunk
        (:func:`~hpccomm.kernels.qsgd.qsgd_owner_step`): the rank-order sum
        of the received packets (which must share their bit width and bucket
        size), ``+ e``, its packet, ``e_out = w - decode(packet)``
        (``e_out=None``: no owner residual, ``w = acc``) and ``out =
        decode(packet)``, with the bits of the separate steps.  Returns the
        packet.  With ``elias`` every received packet is validated and
        transcoded to integer codes first, then summed into ``out`` and
        re-quantized (:func:`~hpccomm.kernels.qsgd.qsgd_requantize`):
        the same bits."""
        m = out.size
        fields = None
        headers = []
        for packet in received:
            headers.append(self.check_packet(packet, out))
            f = self._fields(headers[-1])
            if fields is None:
                fields = f
            elif f != fields:
                raise PacketError(f"qsgd: packets of one chunk with (bits, bucket) {fields} "
                                  f"and {f}")
        if self.elias:
            return self._elias_owner_step(received, headers, e, e_out, out, ctx)
        rbits, rbucket = fields
        rnb = -(-m // rbucket)
        rscales = payload_rows(received, HEADER_SIZE, np.float32, rnb)
        rcodes = payload_rows(received, HEADER_SIZE + 4 * rnb, np.uint8, -(-(m * rbits) // 8))
        packet, scales, codes, bucket = self._new_packet(m)
        bad = K.qsgd_owner_step(rcodes, rscales, rbits, rbucket, 2 ** (rbits - 1) - 1,
                                None if e_out is None else e, e_out, out,
                                bucket, self.bits, self.levels, self.norm == "max",
                                self._key(ctx), ctx.offset, scales, codes,
                                *self._contract(m, bucket, ctx))
        self._raise_nonfinite(bad)
        return packet

    def _elias_owner_step(self, received, headers, e, e_out, out, ctx):
        m = out.size
        rows = [self._elias_codes(p, h, m) for p, h in zip(received, headers)]
        out[...] = 0
        for rscales, rcodes, rbits, rbucket in rows:
            bitcodes.summed_decode(rcodes, rbucket, 2 ** (rbits - 1) - 1, rscales, out, True)
        packet, scales, codes, bucket = self._new_packet(m)
        bad = K.qsgd_requantize(out, None if e_out is None else e, e_out, bucket, self.bits,
                                self.levels, self.norm == "max", self._key(ctx), ctx.offset,
                                scales, codes, *self._contract(m, bucket, ctx))
        self._raise_nonfinite(bad)
        return self._finish(packet, scales, codes, bucket, m)

    # -- the kernels on laid-out packets (see Codec.bind_packet) --------------
    @property
    def lays_out(self):
        return not self.elias       # an Elias packet's size depends on its codes

    def draw_key(self, seed, rank, step):
        return stream_key(seed, rank, step, self.codec_id)

    def header_extra(self, n, shape):
        return self._bucket(n) | self.bits << 28

    def payload_views(self, packet, n, shape):
        """``(scales, codes, bucket)``: the per-bucket scales and the code
        bytes of a fixed-width packet of ``n`` elements, and its bucket size."""
        bucket = self._bucket(n)
        nb = -(-n // bucket)
        return (packet[HEADER_SIZE:HEADER_SIZE + 4 * nb].view(np.float32),
                packet[HEADER_SIZE + 4 * nb:packet_size(n, self.bits, bucket)], bucket)

    def payload_row_views(self, packets, m, shape):
        """``(codes, scale bytes, bucket)`` of the packets of one chunk of
        ``m``, as rows (the scales as bytes: packets an odd number of bytes
        apart leave them unaligned for a float32 view)."""
        bucket = self._bucket(m)
        nb = -(-m // bucket)
        return (payload_rows(packets, HEADER_SIZE + 4 * nb, np.uint8, -(-(m * self.bits) // 8)),
                payload_rows(packets, HEADER_SIZE, np.uint8, 4 * nb), bucket)

    def encode_views(self, views, x, e, e_out, draw):
        scales, codes, bucket = views
        return K.qsgd_encode_feedback(x, e, bucket, self.bits, self.levels, self.norm == "max",
                                      draw.key, draw.offset, scales, codes, e_out,
                                      *self._contract(x.size, bucket, draw))

    def owner_views(self, rows, e, e_out, out, views, draw):
        rcodes, scale_bytes, rbucket = rows
        rscales = float32_rows(scale_bytes)
        scales, codes, bucket = views
        return K.qsgd_owner_step(rcodes, rscales, self.bits, rbucket, self.levels,
                                 None if e_out is None else e, e_out, out,
                                 bucket, self.bits, self.levels, self.norm == "max",
                                 draw.key, draw.offset, scales, codes,
                                 *self._contract(out.size, bucket, draw))

    def decode_views(self, views, out, add):
        scales, codes, bucket = views
        bitcodes.codes_decode(codes, self.bits, bucket, self.levels, scales, out, add)

    def _decode_into(self, packet, header, out, add):
        if self.elias:
            scales, codes, bits, bucket = self._elias_codes(packet, header, out.size)
            bitcodes.summed_decode(codes, bucket, 2 ** (bits - 1) - 1, scales, out, add)
            return
        bits, bucket = self._fields(header)
        nb = -(-out.size // bucket)
        scales = packet[HEADER_SIZE:HEADER_SIZE + 4 * nb].view(np.float32)
        bitcodes.codes_decode(packet[HEADER_SIZE + 4 * nb:], bits, bucket, 2 ** (bits - 1) - 1,
                       scales, out, add)

    # -- summable form -------------------------------------------------------
    def _nbuckets(self, n):
        return -(-n // self.bucket)

    def shared_scale(self, x):
        x = self._check_input(x)
        scales = np.empty(self._nbuckets(x.size), dtype=np.float32)
        K.bucket_scales(x, self.bucket, self.norm == "max", scales)
        return scales

    def to_summable(self, x, scale, ctx):
        check_no_feedback(self, ctx)
        x = self._check_input(x)
        scales = scale_array(scale, self._nbuckets(x.size), self.name)
        codes = np.empty(x.size, dtype=np.int8)
        K.qsgd_shared_codes(x, self.bucket, self.levels, scales, self._key(ctx), ctx.offset,
                            codes)
        return codes

    def summable_dtype(self, nranks):
        return summed_code_dtype(int(nranks) * self.levels)

    def from_summable(self, total, scale, out, add=False):
        check_total(total, out, self.name)
        scales = scale_array(scale, self._nbuckets(out.size), self.name)
        bitcodes.summed_decode(total, self.bucket, self.levels, scales, out, add)
        return out
