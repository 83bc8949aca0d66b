"""``ebq``: error-bounded uniform quantization (ZCCL / C-Coll style), with an
absolute error ``bound`` per element instead of a bit width.

Codes and step.  The user's ``bound`` ``b`` (a float, ``2**-100 <= b <=
2**64``; default ``1e-3``) gives the step ``s``: ``2 b`` rounded **down** to
4 significant bits, ``s = M 2**k`` with ``M`` an integer in ``[8, 15]``
(so ``8/9 < s / (2 b) <= 1``: at most ``log2(9/8) = 0.17`` bit per element
more than a step of exactly ``2 b``).  A value ``v`` gets the code::

    q = rint(float64(v) / s)      ties to even
    decode: float32(float64(q) * s)

Codes are limited to ``|q| <= QMAX = 2**20 - 1`` in an encode; a value
whose code is beyond raises ``ValueError`` (never wraps), so the codec
takes ``|v|`` up to about ``2**20 s`` (``2**21 b``).

The guarantee, proved in real arithmetic.  (1) ``q`` is the integer nearest
``v / s`` (ties to even), so ``|q s - v| <= s / 2``: write ``v = X 2**a``
(``X`` an integer, ``|X| < 2**24``), ``s = M 2**k``.  If ``v / s`` is not
a half-integer, its distance to every half-integer is at least ``1 / (2
M) >= 1/30`` when ``a >= k``, and at least ``|v / s| / (2 |X|) > 2**-25
|v / s|`` when ``a < k`` -- both more than the float64 division's error
``2**-53 |v / s|`` for ``|v / s| < 2**47`` (far beyond ``QMAX``), so the
rounded quotient rounds to the same integer; a half-integer quotient (below
``2**22`` in range) is exact in float64 and ``rint`` breaks the tie as
exact arithmetic would.  (2) The decode is exact: ``q s = (q M) 2**k`` with
``|q M| < 2**24`` is a float32 (``s >= 2**-100`` keeps it normal).  So
every decoded element satisfies ``|decode - v| <= s / 2 <= b``, in real
arithmetic, for every finite float32 ``v`` whose code fits -- subnormals,
+-0 (code 0; -0 decodes to +0) and exact half-steps included.  NaN/Inf
raise ``NonFiniteError`` (``nonfinite="propagate"`` is refused: there is
no code for them).

Sums of codes.  Decoded values are integer multiples of the same ``s``, so
owners add **codes** (int64) and send the integer sum at no new error
(:meth:`EbqCodec.owner_step`); packets carry codes up to ``|q| < 2**49``
(width 50), which decode with one rounding to nearest float32 (the float64
product is exact), and exactly while ``|q| <= 2**20``.

End-to-end bounds of an allreduce (sum; ``x_p`` rank ``p``'s input, ``S =
sum_p x_p`` exact, ``r`` the result, ``u = 2**-24``; ``ulp(r)``: the
float32 spacing at ``r``), without error feedback:

* ``twoshot`` (fused, the default): ``|r - S| <= P b + ulp(r) / 2``; the
  ``ulp`` term is zero where the summed code is at most ``2**20`` in
  magnitude.  With ``fused=False`` (the three-step reference path) the
  owner adds float32 values: exact while partial sums of codes stay within
  ``2**20``, beyond that each addition may round (``ulp / 2``) and the
  re-encode adds up to ``b``.
* ``allgather``: the same as ``twoshot`` (every rank adds the received
  **codes** in int64, :meth:`EbqCodec.decode_sum`, then rounds once).
* ``summable``: the same: one integer ``MPI_Allreduce`` of the codes (int32
  up to 2048 ranks, int64 beyond), one rounding.
* ``hierarchical``: the node sums are float32 sums of ``L_k`` inputs (``L``
  the largest node) before the outer algorithm sees them: ``|r - S| <= N b
  + gamma_(L-1) sum_p |x_p| + ulp(r) / 2`` (``N`` nodes, ``gamma_m = m u /
  (1 - m u)``) with ``outer`` ``twoshot`` / ``allgather`` / ``summable``.
* ``auto``: the bound of its choice -- ``twoshot`` / ``allgather`` as
  above, ``dense`` (``MPI_Allreduce`` of the inputs themselves, no
  quantization) ``|r - S| <= gamma_(P-1) sum_p |x_p|``.
* the sparse algorithms refuse ``ebq`` (a dense quantizer).

With error feedback the same bounds hold for the compensated vectors ``v_p
= x_p + e_p`` in place of ``x_p`` (``|e_p| <= b``).  Error feedback is off
by default (``biased = False``): the bound is the guarantee, and a residual
only moves the error from one call to the next.

Range checks before any transfer.  When the reducer's cross-rank check
runs before the encode, it also checks ``|x| <= (QMAX - 1) s / T``
(:meth:`EbqCodec.check_values`; ``T = P`` for ``hierarchical``, whose node
sums are encoded, else 1; one step of margin for a residual; device input
through a host copy, as ebq has no device twin), so a value out of range is
raised on every rank; when the check is fused into the encode, the
encode's own error goes through it.

Layout (version 1), little-endian::

    offset      size    field
    0           16      common header: codec id 12, extra = 64 (the block
                        length B; any other value is invalid), n
    16          4       float32 step s (must equal this codec's)
    20          C       uint8 width w_c of block c (C = ceil(n / B)), 0..50
    20 + C      ...     block c's codes, ceil(m_c w_c / 8) bytes (m_c = B, or
                        n - B (C - 1) for the last block), blocks back to back

Block ``c`` holds elements ``[B c, B c + m_c)``; its width is the bit
length of its largest zig-zag code ``z = (q << 1) ^ (q >> 63)`` (0 for an
all-zero block, no bytes); element ``k`` of the block takes bits ``k w_c ..
k w_c + w_c - 1`` of the block's LSB-first bit stream; the padding bits of
its last byte are zero.  Packet size: ``20 + C + sum_c ceil(m_c w_c / 8)``
bytes; a worker packet has ``w_c <= 21``, so :meth:`EbqCodec.max_wire_size`
is ``20 + C + sum_c ceil(21 m_c / 8)`` (owner packets of ``P`` ranks may be
``ceil(log2 P)`` bits wider per element).  Decoders check the header, the
step, every width and the exact size before any kernel runs.  Blocks are
independent: :meth:`EbqCodec.align` and :meth:`EbqCodec.segment_unit`
return ``B``.
"""
import math

import numpy as np

from ..errors import NonFiniteError, PacketError
from ..kernels import ebq as K
from .base import HEADER_SIZE, Codec, EncodeContext, register_codec

BLOCK = K.BLOCK
#: bytes before the widths: the common header and the step
FIELDS = HEADER_SIZE + 4
#: the widest code of a worker packet: the zig-zag of |q| <= QMAX
WORKER_WIDTH = int(2 * K.QMAX).bit_length()
#: the bound's range (steps stay normal float32, owners' sums finite)
BOUND_MIN, BOUND_MAX = 2.0 ** -100, 2.0 ** 64
#: the most ranks whose codes sum in int32 (``summable``)
INT32_RANKS = (2 ** 31 - 1) // K.QMAX


def step_of(bound: float) -> float:
    """The step of ``bound``: ``2 bound`` rounded down to 4 significant bits."""
    m, e = math.frexp(2.0 * bound)      # 2 bound = m 2**e, 0.5 <= m < 1
    return math.ldexp(math.floor(m * 16.0), e - 4)


def _block_bytes(widths: np.ndarray, n: int) -> int:
    """Payload bytes of a packet of ``n`` elements with block ``widths``."""
    C = widths.size
    if C == 0:
        return 0
    w = widths.astype(np.int64)
    last = n - BLOCK * (C - 1)
    return int(8 * w[:C - 1].sum()) + (last * int(w[C - 1]) + 7) // 8


@register_codec
class EbqCodec(Codec):
    name = "ebq"
    dense = True
    codec_id = 12
    fixed_size = False
    summable = True
    biased = False
    elementwise_bound = True

    def __init__(self, bound: float = 1e-3, nonfinite: str = "raise"):
        super().__init__(nonfinite=nonfinite)
        if nonfinite != "raise":
            raise ValueError("ebq: nonfinite must be 'raise': an error-bounded code has no "
                             "NaN or Inf")
        if isinstance(bound, bool) or not isinstance(bound, (int, float, np.integer,
                                                             np.floating)):
            raise ValueError(f"ebq: bound must be a float, not {bound!r}")
        bound = float(bound)
        if not (math.isfinite(bound) and BOUND_MIN <= bound <= BOUND_MAX):
            raise ValueError(f"ebq: bound must be a finite float in [2**-100, 2**64], "
                             f"not {bound!r}")
        self.bound = bound
        #: the quantization step (a float32 of 4 significant bits, <= 2 bound)
        self.step = step_of(bound)
        self._step32 = np.float32(self.step)

    def params(self):
        return {"bound": self.bound}

    def align(self, shape):
        return BLOCK

    def segment_unit(self, shape):
        return BLOCK    # blocks are independent

    def check_tolerance(self, nranks, error_feedback):
        # the rms of a uniform error of +-s/2 per rank, against N(0, 1)
        # inputs: s / sqrt(12); a wide margin (this catches corruption)
        return min(2.0, max(1e-5 * max(1, nranks), 2.0 * self.step))

    # -- sizes -------------------------------------------------------------
    def capacity_for(self, n, shape):
        """None: the owner's packet holds summed codes, wider than a
        worker's, so :meth:`max_wire_size` bounds only the workers'."""
        return None

    def max_wire_size(self, n):
        C = -(-n // BLOCK)
        full, last = divmod(n, BLOCK)
        return FIELDS + C + full * (BLOCK * WORKER_WIDTH // 8) + (last * WORKER_WIDTH + 7) // 8

    def _packet_size(self, packet, header):
        if int(header["extra"]) != BLOCK:
            raise PacketError(f"ebq: block field {int(header['extra'])} is not {BLOCK}")
        n = int(header["n"])
        C = -(-n // BLOCK)
        if packet.size < FIELDS + C:
            raise PacketError(f"ebq: packet of {packet.size} bytes is shorter than its "
                              f"{FIELDS + C} bytes of header, step and block widths")
        step = packet[HEADER_SIZE:FIELDS].view(np.float32)[0]
        if step != self._step32:
            raise PacketError(f"ebq: packet step {float(step)!r} is not this codec's "
                              f"{self.step!r} (bound={self.bound!r})")
        widths = packet[FIELDS:FIELDS + C]
        if C and int(widths.max()) > K.WIDTH_MAX:
            raise PacketError(f"ebq: a block width of {int(widths.max())} bits exceeds "
                              f"{K.WIDTH_MAX}")
        return FIELDS + C + _block_bytes(widths, n)

    # -- encode ------------------------------------------------------------
    def _new(self, nbytes, n):
        packet = self.new_packet(nbytes, n, extra=BLOCK, zeroed=False)
        packet[HEADER_SIZE:FIELDS].view(np.float32)[0] = self._step32
        return packet

    def _raise_range(self, v, index, ctx: EncodeContext):
        raise ValueError(
            f"ebq: value {float(v)!r} at index {ctx.offset + index} is beyond the code range "
            f"+-{K.QMAX} steps of {self.step!r} (|v| <= {K.QMAX * self.step:.7g}) of "
            f"bound={self.bound!r}: use a larger bound or scale the input")

    def _encode_v(self, x, e, e_out, ctx, feedback):
        n = x.size
        C = -(-n // BLOCK)
        packet = self._new(self.max_wire_size(n), n)
        widths = packet[FIELDS:FIELDS + C]
        nbytes, bad, over = K.ebq_encode(x, x if e is None else e, e is not None, feedback,
                                         self.step, widths, packet[FIELDS + C:],
                                         x if e_out is None else e_out)
        if bad:
            raise NonFiniteError(f"ebq: input holds {bad} NaN/Inf value(s) "
                                 "(policy nonfinite='raise')")
        if over >= 0:
            self._raise_range(x[over] + (0 if e is None else e[over]), over, ctx)
        return packet[:FIELDS + C + nbytes]

    def encode(self, x, ctx=EncodeContext()):
        """The packet of ``x`` (its kernel counts NaN/Inf on its one pass)."""
        x = self._check_input(x, scan=False)
        return self._encode_v(x, None, None, ctx, False)

    def encode_with_feedback(self, x, e, e_out, ctx):
        """The packet of ``v = x + e`` (``v = x`` for ``e=None``) and
        ``e_out = v - decode(packet)`` in one pass
        (:func:`~hpccomm.kernels.ebq.ebq_encode`); ``|e_out| <= b``."""
        x, e, e_out = self._feedback_arrays(x, e, e_out)
        return self._encode_v(x, e, e_out, ctx, True)

    def check_values(self, x: np.ndarray, terms: int = 1, feedback: bool = False) -> None:
        """Raise ``ValueError`` if some ``|x_i| > (QMAX - f) s / terms``
        (``f`` 1 with ``feedback``, else 0): what an encode of a sum of
        ``terms`` such values (plus a residual) could not code.  NaN/Inf
        are left to the caller's scan."""
        x = np.asarray(x).reshape(-1)
        if x.dtype != np.float32:
            x = x.astype(np.float32)
        limit = (K.QMAX - (1 if feedback else 0)) * self.step / max(1, int(terms))
        i = K.ebq_first_beyond(x, limit)
        if i >= 0:
            raise ValueError(
                f"ebq: value {float(x[i])!r} at index {i} is beyond the code range: |x| must "
                f"be at most {limit:.7g} (+-{K.QMAX} steps of {self.step!r} of "
                f"bound={self.bound!r}"
                + (f", over {terms} summed inputs" if terms > 1 else "")
                + (", one step kept for the residual" if feedback else "")
                + "): use a larger bound or scale the input")

    # -- decode ------------------------------------------------------------
    def _fields(self, packet, n):
        C = -(-n // BLOCK)
        return packet[FIELDS:FIELDS + C], packet[FIELDS + C:]

    def _decode_into(self, packet, header, out, add):
        widths, payload = self._fields(packet, out.size)
        K.ebq_decode(widths, payload, self.step, out, add)

    def _sum_codes(self, packets, m):
        """The int64 sum of the codes of validated ``packets`` of ``m``."""
        acc = np.zeros(m, dtype=np.int64)
        for packet in packets:
            widths, payload = self._fields(packet, m)
            K.ebq_add_codes(widths, payload, acc)
        return acc

    def decode_sum(self, packets, out):
        """``out`` = the sum of the decoded ``packets``, as one rounding of
        the exact sum ``(sum of codes) * s`` (``allgather``'s decode: the
        order of the packets does not matter)."""
        for packet in packets:
            self.check_packet(packet, out)
        K.ebq_values(self._sum_codes(packets, out.size), self.step, out, False)
        return out

    # -- the owner of twoshot ------------------------------------------------
    def owner_step(self, received, e, e_out, out, ctx):
        """The owner stage of ``twoshot``: ``Q = sum of the received codes``
        (int64: exact), plus the code of the owner residual ``e`` if any
        (``e_out = e - decode(code(e))``; ``e_out`` without ``e``: zeros),
        its packet (no new error) and ``out = float32(Q s)``.  Returns the
        packet."""
        m = out.size
        for packet in received:
            self.check_packet(packet, out)
        acc = self._sum_codes(received, m)
        if e is not None:
            bad, over = K.ebq_add_residual_codes(e, self.step, acc, out if e_out is None
                                                 else e_out, e_out is not None)
            if bad:
                raise NonFiniteError(f"ebq: owner residual holds {bad} NaN/Inf value(s)")
            if over >= 0:
                self._raise_range(e[over], over, ctx)
        elif e_out is not None:
            e_out[...] = 0
        C = -(-m // BLOCK)
        widths = np.empty(C, dtype=np.uint8)
        nbytes, big = K.ebq_sizes(acc, widths)
        if big > K.QWIRE:   # beyond 2**29 ranks of QMAX codes: never wrap
            raise ValueError(f"ebq: a summed code of {big} exceeds the packet range "
                             f"+-{K.QWIRE}")
        packet = self._new(FIELDS + C + nbytes, m)
        packet[FIELDS:FIELDS + C] = widths
        K.ebq_pack(acc, widths, packet[FIELDS + C:])
        K.ebq_values(acc, self.step, out, False)
        return packet

    # -- summable form ---------------------------------------------------------
    def shared_scale(self, x):
        return None     # the step is fixed by the bound: nothing to agree on

    def to_summable(self, x, scale, ctx):
        """The int32 codes of ``x``."""
        x = self._check_input(x, scan=False)
        codes = np.empty(x.size, dtype=np.int32)
        bad, over = K.ebq_codes(x, self.step, codes)
        if bad:
            raise NonFiniteError(f"ebq: input holds {bad} NaN/Inf value(s) "
                                 "(policy nonfinite='raise')")
        if over >= 0:
            self._raise_range(x[over], over, ctx)
        return codes

    def summable_dtype(self, nranks):
        return np.dtype(np.int32 if nranks <= INT32_RANKS else np.int64)

    def from_summable(self, total, scale, out, add=False):
        K.ebq_values(np.ascontiguousarray(total).reshape(-1), self.step, out, add)
        return out
