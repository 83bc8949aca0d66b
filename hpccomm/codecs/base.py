"""The codec protocol, the common packet header, and the codec registry.

A codec turns one rank's float32 vector into one contiguous ``uint8`` packet
and back.  It is pure: no state lives in it between calls (error feedback is
:mod:`hpccomm.memory`'s job), and everything random is drawn from a
counter-based hash of ``(seed, rank, step, global index)`` carried by
:class:`EncodeContext`, so results do not depend on thread counts, chunking or
the device.

Every packet starts with the same 16-byte little-endian header::

    offset  size  field
    0       2     magic  b"HC"
    2       1     format version of the codec's layout
    3       1     codec id (see each codec's module)
    4       4     codec-specific uint32 (flags, or a count)
    8       8     n: number of elements encoded (uint64)

followed by the codec's own fields and payload, which each codec documents.
Decoders validate the header and the exact total size **before** any kernel
touches the payload: numba kernels do no bounds checks, so a truncated,
oversized or corrupt packet must be rejected in Python with
:class:`~hpccomm.errors.PacketError`.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import ClassVar, Dict, Optional, Tuple, Type

import numpy as np

from ..errors import NonFiniteError, PacketError
from ..kernels.nonfinite import count_nonfinite
from ..registry import Registry

MAGIC = b"HC"
HEADER = np.dtype([("magic", "S2"), ("version", "<u1"), ("codec", "<u1"), ("extra", "<u4"),
                   ("n", "<u8")])
HEADER_SIZE = HEADER.itemsize  # 16
#: leading bytes of a packet from which every codec's header check
#: (:meth:`Codec.check_header`) finds the packet's size
HEAD_BYTES = 64
#: the same layout for :mod:`struct` (a header costs ~0.3 us this way, ~3 us
#: through a structured numpy view: it matters for many small packets)
_HEADER_STRUCT = struct.Struct("<2sBBIQ")
_HEADER_FIELDS = ("magic", "version", "codec", "extra", "n")
#: headers (with packet size and n) a codec remembers as checked
PASSED_HEADERS = 256
_F32, _U8 = np.dtype(np.float32), np.dtype(np.uint8)
#: column length of the per-column codecs (onebit, adaptive) for input of
#: fewer than two axes when no ``col_len`` is given: short enough that chunked
#: algorithms cut a 1-D vector into balanced chunks (a whole-vector column gave
#: rank 0 every chunk), long enough that the 8 bytes of a column cost 1/512 bit
#: per element (see docs/results.md for the measurement behind it)
VECTOR_COLUMN = 4096


@dataclass(frozen=True)
class EncodeContext:
    """Where an encode call sits, for reproducible random numbers.

    ``offset`` is the global index of the first element of the vector being
    encoded (chunks of a larger vector pass their start), so element ``i`` of a
    chunk draws the same random number as element ``offset + i`` of the whole.
    """

    seed: int = 0
    rank: int = 0
    step: int = 0
    offset: int = 0
    #: shape of the user's tensor, for codecs with per-column statistics
    #: (empty: treat the vector as 1-D)
    shape: tuple = ()
    #: the caller has already checked that the input is finite (the reducer's
    #: scan of the very data being encoded): the codec skips its own scan
    finite: bool = False
    #: the encode runs under error feedback (``v = g + e``; ``e = v -
    #: decode``): the unbiased stochastic codecs (qsgd, terngrad, randk) then
    #: send the contractive ``C(v) / (1 + omega)`` of their variance factor
    #: ``omega`` (each codec's docstring says how) -- error feedback needs a
    #: contractive compressor
    feedback: bool = False
    #: under error feedback, the fresh part of the vector being encoded (``g``
    #: of ``v = g + e``, the same length), or None (``v`` itself is fresh):
    #: codecs whose parameter scales with the input (threshold's ``alpha``)
    #: take the scale from it, not from ``v``, whose residual grows
    fresh: Optional[np.ndarray] = field(default=None, compare=False, repr=False)


def payload_rows(packets, offset: int, dtype, count: int) -> np.ndarray:
    """``count`` elements of ``dtype`` at byte ``offset`` of every packet, as
    the rows of one read-only 2-D array: a strided view when the packets lie
    equally spaced in one buffer (a list with ``buffer`` and ``stride``
    attributes, as the transport's all-to-all returns them), else a copy
    with rows as strided."""
    dtype = np.dtype(dtype)
    stride = getattr(packets, "stride", None)
    if stride and stride % dtype.itemsize == 0 and count * dtype.itemsize + offset <= stride:
        rows = np.ndarray((len(packets), count), dtype, buffer=packets.buffer, offset=offset,
                          strides=(stride, dtype.itemsize))
        rows.flags.writeable = False
        return rows
    rows = _rows_as_viewed(len(packets), count, dtype)
    for row, p in zip(rows, packets):
        row[:] = p[offset:offset + count * dtype.itemsize].view(dtype)
    rows.flags.writeable = False
    return rows


def _rows_as_viewed(r: int, count: int, dtype) -> np.ndarray:
    """Empty rows for a copy laid out like :func:`payload_rows`' view (rows
    one element apart more than their length), so that kernels see one array
    type either way and numba compiles them once, not once per layout."""
    return np.empty((r, count + 1), dtype)[:, :count]


def float32_rows(byte_rows: np.ndarray) -> np.ndarray:
    """The float32 values held as bytes in the rows of ``byte_rows`` (a
    packet field), read-only, with the array type of :func:`payload_rows`'s
    float32 rows, so that numba compiles a kernel once for both: a view
    where every row is 4-byte aligned, else a copy laid out as
    :func:`payload_rows` lays out its copies."""
    rows = byte_rows.view(np.float32)
    if not rows.flags.aligned:
        rows = _rows_as_viewed(byte_rows.shape[0], byte_rows.shape[1] // 4, np.float32)
        rows.view(np.uint8)[...] = byte_rows
    rows.flags.writeable = False
    return rows


class Draw:
    """What a laid-out encode (``encode_views``, ``owner_views``) of a
    stochastic codec reads of its :class:`EncodeContext`: ``key``, the
    random stream of this call's encodes as one rank (:meth:`Codec.draw_key`
    of ``seed``, ``rank`` and ``step``; set per call), ``offset``, the
    chunk's first element in the whole vector, and ``feedback``, whether
    the call keeps a residual memory.  A plan makes one per chunk."""

    __slots__ = ("key", "offset", "feedback")

    def __init__(self, offset: int, feedback: bool, key: int = 0):
        self.key, self.offset, self.feedback = key, int(offset), bool(feedback)


class Codec:
    """Base class of all codecs.

    Subclasses set the class attributes and implement :meth:`_encode`,
    :meth:`_decode_into` (validated packet -> dense values, add or overwrite) and
    :meth:`_payload_size` (exact packet size given the header), and may
    override :meth:`wire_size` and :meth:`max_wire_size`.
    """

    name: ClassVar[str] = ""
    codec_id: ClassVar[int] = 0
    version: ClassVar[int] = 1
    #: decode(encode(x)) == x for finite float32 input
    lossless: ClassVar[bool] = False
    #: draws random numbers (reproducibly, from EncodeContext)
    stochastic: ClassVar[bool] = False
    #: packets can be summed code-by-code when the scale is shared
    summable: ClassVar[bool] = False
    #: what makes a codec that can be summable so, named when it is not
    #: (e.g. threshold's fixed ``tau=``)
    summable_when: ClassVar[str] = ""
    #: packet size depends only on n (so counts need not be exchanged)
    fixed_size: ClassVar[bool] = True
    #: biased estimator that needs error feedback to converge
    biased: ClassVar[bool] = False
    #: encodes every element (a quantizer): the sparse algorithms, which send
    #: (index, value) pairs of the decoded vector, refuse it
    dense: ClassVar[bool] = False
    #: the summable form honours ``EncodeContext.feedback`` (False: algorithm
    #: ``summable`` refuses error feedback with this codec)
    summable_feedback: ClassVar[bool] = True
    #: the pieces of a chunk are encoded against a statistic of the whole
    #: chunk (see :meth:`segment_unit`)
    chunk_statistic: ClassVar[bool] = False
    #: chunk boundaries used by algorithms are multiples of this many elements
    unit: ClassVar[int] = 1
    #: user dtypes the codec serves; codecs always see float32 (the caller
    #: widens float16 / bfloat16 and rounds the result back)
    input_dtypes: ClassVar[Tuple[str, ...]] = ("float32", "float16", "bfloat16")
    #: guarantees an error bound per element (``ebq``): a transform that mixes
    #: elements before it (``rotate=True``) would void the guarantee
    elementwise_bound: ClassVar[bool] = False
    #: the one algorithm that carries a codec without packets (``powersgd``,
    #: whose factors its own algorithm reduces); None: any algorithm that
    #: takes its packets
    algorithm: ClassVar[Optional[str]] = None

    def __init__(self, nonfinite: str = "raise"):
        if nonfinite not in ("raise", "propagate"):
            raise ValueError(f"nonfinite must be 'raise' or 'propagate', not {nonfinite!r}")
        self.nonfinite = nonfinite

    # -- description -------------------------------------------------------
    def params(self) -> Dict[str, object]:
        """Parameters that must be equal on every rank (used in validation)."""
        return {}

    def describe(self) -> str:
        p = ",".join(f"{k}={v}" for k, v in sorted(self.params().items()))
        return f"{self.name}({p})"

    def __repr__(self) -> str:
        return f"<codec {self.describe()}>"

    def check_tolerance(self, nranks: int, error_feedback: bool) -> float:
        """Relative L2 error (against the exact sum of Gaussian inputs) above
        which ``hpccomm.bench allreduce --check`` calls a result wrong.  A
        sanity bound that catches corruption, not a precision guarantee;
        lossless codecs: float32 reassociation only."""
        return 1e-5 * max(1, nranks) if self.lossless else 2.0

    def align(self, shape: tuple) -> int:
        """Chunk alignment in elements for a tensor of ``shape``: algorithms
        that cut a vector into chunks put boundaries at multiples of this
        (e.g. the column length of per-column codecs).  Default: ``unit``."""
        return self.unit

    def segment_unit(self, shape: tuple) -> Optional[int]:
        """Elements at whose multiples, counted from a chunk's start, the
        chunk may be cut into pieces that are encoded, reduced and decoded
        separately with the same bits -- what lets ``twoshot`` pipeline a
        chunk in segments (the codec must also have ``owner_step``).  None
        (the default) when a statistic spans the whole chunk (top-k's
        selection), unless the codec sets ``chunk_statistic`` and encodes
        pieces against their chunk's statistic:

        * ``chunk_stat(x, e, ctx)``: the statistic of ``v = x + e`` over a
          whole chunk; ``encode_piece(x, e, e_out, stat, ctx)``: the packet
          of a piece (``ctx.offset`` its start; with ``e_out`` the residual),
          the bits of the chunk's encode over those elements;
        * the owner: ``owner_begin()``, then ``owner_add(received, e, out,
          lo, hi, acc)`` for every piece in order (the rank-order sum into
          ``out[lo:hi]`` and the running statistic of ``w = out + e``),
          ``owner_stat(acc, e, out, ctx)``, and ``owner_encode_piece(e,
          e_out, out, lo, hi, stat, ctx)`` per piece, which writes the
          decoded values into ``out[lo:hi]`` (``terngrad``)."""
        return None

    # -- summable form (codecs with summable = True) -------------------------
    # Algorithm "summable" reduces such codecs with one MPI_Allreduce:
    #   scale = MAX-allreduce of shared_scale(x)          (skipped when None)
    #   codes = to_summable(x, scale, ctx)                 (int8 codes / float32 values)
    #   total = SUM-allreduce of codes widened to summable_dtype(P)
    #   from_summable(total, scale, out)                   -> dense float32
    # and error feedback uses from_summable(codes, scale, ...) as the decoded
    # value of this rank's own contribution.
    def shared_scale(self, x: np.ndarray) -> Optional[np.ndarray]:
        """float32 array to MAX-reduce across ranks before encoding, or None."""
        raise NotImplementedError(f"codec {self.name!r} is not summable")

    def to_summable(self, x: np.ndarray, scale: Optional[np.ndarray],
                    ctx: EncodeContext) -> np.ndarray:
        """This rank's contribution in a form that sums elementwise."""
        raise NotImplementedError(f"codec {self.name!r} is not summable")

    def summable_dtype(self, nranks: int) -> np.dtype:
        """dtype wide enough to hold the sum over ``nranks`` contributions."""
        raise NotImplementedError(f"codec {self.name!r} is not summable")

    def from_summable(self, total: np.ndarray, scale: Optional[np.ndarray], out: np.ndarray,
                      add: bool = False) -> np.ndarray:
        """Dense float32 values of a (summed) summable contribution."""
        raise NotImplementedError(f"codec {self.name!r} is not summable")

    # -- sizes -------------------------------------------------------------
    def wire_size(self, n: int) -> Optional[int]:
        """Exact packet size in bytes for ``n`` elements, or ``None`` when it
        depends on the data."""
        return None

    def wire_size_for(self, n: int, shape: tuple) -> Optional[int]:
        """Exact packet size for ``n`` elements of a tensor of ``shape`` (a
        chunk of it encodes with the tensor's shape), or None when it depends
        on the data.  Default: :meth:`wire_size` for fixed-size codecs."""
        return self.wire_size(n) if self.fixed_size else None

    def max_wire_size(self, n: int) -> int:
        """An upper bound on the packet size for ``n`` elements."""
        size = self.wire_size(n)
        if size is None:
            raise NotImplementedError
        return size

    def capacity_for(self, n: int, shape: tuple) -> Optional[int]:
        """Bytes that hold any packet of ``n`` elements of a tensor of
        ``shape`` that this codec writes, in an encode or an owner step: its
        fixed size, else :meth:`max_wire_size`; None where the codec has no
        such bound (a codec whose owner packets outgrow :meth:`max_wire_size`
        overrides this).  A slot of this size carries a packet whose own
        size the header gives (:meth:`packet_in_slot`)."""
        size = self.wire_size_for(n, shape)
        if size is not None:
            return size
        try:
            return self.max_wire_size(n)
        except NotImplementedError:
            return None

    def packet_in_slot(self, slot: np.ndarray, n: int) -> np.ndarray:
        """The packet of ``n`` elements at the start of ``slot`` (uint8, of
        :meth:`capacity_for` bytes; what follows the packet is not read):
        the first bytes its header implies, refused with a PacketError when
        the header is not this codec's or implies more than the slot."""
        header = self.parse_header(slot, n)
        size = self._packet_size(slot, header)
        if size > slot.size:
            raise PacketError(f"{self.name}: packet of {size} bytes announced in a slot of "
                              f"{slot.size}")
        return slot[:size]

    # -- encode / decode ---------------------------------------------------
    def encode(self, x: np.ndarray, ctx: EncodeContext = EncodeContext()) -> np.ndarray:
        """Encode a 1-D float32 array into a packet (``uint8`` array)."""
        x = self._check_input(x, scan=not ctx.finite)
        return self._encode(x, ctx)

    def reencode(self, x: np.ndarray, ctx: EncodeContext = EncodeContext()) -> np.ndarray:
        """Encode ``x`` that is a sum of this codec's decoded packets of the same
        ``ctx.step`` and ``ctx.offset`` (the owner stage of ``twoshot``).  The
        default is :meth:`encode`; a codec whose decoded sums it can send
        exactly (``randk``: zero off the shared indices) overrides it."""
        return self.encode(x, ctx)

    def decode(self, packet: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Overwrite ``out`` (float32, length n) with the decoded values."""
        header = self.check_packet(packet, out)
        self._decode_into(packet, header, out, add=False)
        return out

    def decode_add(self, packet: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Add the decoded values to ``out`` (float32, length n)."""
        header = self.check_packet(packet, out)
        self._decode_into(packet, header, out, add=True)
        return out

    def roundtrip(self, x: np.ndarray, ctx: EncodeContext = EncodeContext()) -> np.ndarray:
        out = np.empty(x.size, dtype=np.float32)
        return self.decode(self.encode(x, ctx), out)

    # -- to implement ------------------------------------------------------
    def _encode(self, x: np.ndarray, ctx: EncodeContext) -> np.ndarray:
        raise NotImplementedError

    def _decode_into(self, packet: np.ndarray, header, out: np.ndarray, add: bool) -> None:
        raise NotImplementedError

    def _payload_size(self, header) -> int:
        """Exact total packet size (header included) implied by the header;
        raise PacketError if the header's own fields are inconsistent."""
        size = self.wire_size(int(header["n"]))
        if size is None:
            raise NotImplementedError
        return size

    def _packet_size(self, packet: np.ndarray, header) -> int:
        """Exact total size of ``packet``; by default :meth:`_payload_size`.
        Codecs whose size also depends on fields after the common header
        override this (and raise PacketError when those bytes are missing)."""
        return self._payload_size(header)

    # -- helpers for subclasses ---------------------------------------------
    def _check_input(self, x: np.ndarray, scan: bool = True) -> np.ndarray:
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{self.name}: expected a numpy array, got {type(x).__name__}")
        if x.dtype != np.float32:
            raise TypeError(f"{self.name}: expected float32 input, got {x.dtype}")
        if x.ndim != 1:
            x = x.reshape(-1)
        if not x.flags.c_contiguous:
            raise ValueError(f"{self.name}: input is not contiguous")
        if scan and self.nonfinite == "raise" and x.size and (bad := count_nonfinite(x)):
            raise NonFiniteError(f"{self.name}: input holds {bad} NaN/Inf value(s) "
                                 "(policy nonfinite='raise')")
        return x

    def _feedback_arrays(self, x, e, e_out):
        """Check the arrays of an ``encode_with_feedback(x, e, e_out, ctx)``:
        float32, contiguous, one length (``e`` and ``e_out`` may be None);
        return them flat."""
        x = np.asarray(x)
        n = x.size
        for name, a in (("x", x), ("e", e), ("e_out", e_out)):
            if a is not None and (not isinstance(a, np.ndarray) or a.dtype != _F32
                                  or a.size != n or not a.flags.c_contiguous):
                raise ValueError(f"{self.name}: {name} must be contiguous float32 of "
                                 f"{n} elements")
        if x.ndim == 1 and all(a is None or a.ndim == 1 for a in (e, e_out)):
            return x, e, e_out
        return tuple(None if a is None else a.reshape(-1) for a in (x, e, e_out))

    def nonfinite_error(self, bad: int) -> Optional[NonFiniteError]:
        """The error for ``bad`` non-finite values counted by a fused kernel
        under ``nonfinite="raise"``, else None."""
        if bad and self.nonfinite == "raise":
            return NonFiniteError(f"{self.name}: input holds {bad} NaN/Inf value(s) "
                                  "(policy nonfinite='raise')")
        return None

    def _raise_nonfinite(self, bad: int) -> None:
        """Raise :meth:`nonfinite_error` when there is one."""
        if bad and (err := self.nonfinite_error(bad)) is not None:
            raise err

    def new_packet(self, nbytes: int, n: int, extra: int = 0, zeroed: bool = True) -> np.ndarray:
        """A packet of ``nbytes`` with the common header filled in, its payload
        zeroed -- or left as allocated with ``zeroed=False``, for encoders
        whose kernels write every payload byte (a 32 MiB packet costs a write
        pass to zero)."""
        packet = (np.zeros if zeroed else np.empty)(nbytes, dtype=np.uint8)
        _HEADER_STRUCT.pack_into(packet, 0, MAGIC, self.version, self.codec_id, extra, n)
        return packet

    # -- kernels on packets laid out once --------------------------------------
    # A codec whose packet layout depends only on (n, shape) may offer its
    # kernels on packets laid out once -- a repeated call's plan
    # (:class:`hpccomm.collectives.twoshot.TwoShotPlan`) writes the headers
    # and takes the payload views when it is made, then runs the kernels
    # alone.  Such a codec implements, besides ``encode_with_feedback`` and
    # ``owner_step`` (which it builds from them):
    #
    # * ``payload_views(packet, n, shape)``: the payload of a packet of ``n``
    #   elements as the arrays its kernels take;
    # * ``payload_row_views(packets, m, shape)``: the same for the packets of
    #   one chunk of ``m``, equally spaced in one buffer, as rows;
    # * ``encode_views(views, x, e, e_out, draw) -> bad``:
    #   ``encode_with_feedback`` into ``views`` (NaN/Inf counted, not raised);
    # * ``owner_views(rows, e, e_out, out, views, draw) -> bad``:
    #   ``owner_step`` from ``rows`` into ``views``;
    # * ``decode_views(views, out, add)``;
    # * ``header_extra(n, shape)`` where the header's ``extra`` is not 0.
    #
    # ``draw`` (a :class:`Draw`) is what a stochastic codec's encode reads of
    # its context: the call's random stream (:meth:`draw_key`), the chunk's
    # offset and whether the call keeps a residual; the others ignore it.

    @property
    def lays_out(self) -> bool:
        """Whether this codec offers its kernels on laid-out packets (its
        packets' layout a function of ``(n, shape)`` alone)."""
        return getattr(self, "payload_views", None) is not None

    def draw_key(self, seed: int, rank: int, step: int) -> int:
        """The key of the random stream of an encode as ``rank`` at ``step``
        (:attr:`Draw.key`; the one ``encode_with_feedback`` derives from its
        context); 0 for a deterministic codec."""
        return 0

    def draw(self, ctx: EncodeContext) -> Draw:
        """The :class:`Draw` an encode in ``ctx`` reads."""
        return Draw(ctx.offset, ctx.feedback, self.draw_key(ctx.seed, ctx.rank, ctx.step))

    def header_extra(self, n: int, shape: tuple) -> int:
        """The codec-specific uint32 of the header of a packet of ``n``."""
        return 0

    def bind_header(self, packet: np.ndarray, n: int, extra: int = 0) -> None:
        """Write the common header of a packet of ``n`` elements into ``packet``."""
        _HEADER_STRUCT.pack_into(packet, 0, MAGIC, self.version, self.codec_id, extra, n)

    def bind_packet(self, packet: np.ndarray, n: int, shape: tuple):
        """Write the header of ``packet`` (of this codec's size for ``n``
        elements of a tensor of ``shape``) and return its
        ``payload_views``."""
        self.bind_header(packet, n, self.header_extra(n, shape))
        return self.payload_views(packet, n, shape)

    def new_bound_packet(self, n: int, shape: tuple):
        """A new packet of ``n`` elements of a tensor of ``shape``, its header
        written (:meth:`bind_packet`): ``(packet, payload views)``."""
        packet = np.empty(self.wire_size_for(n, shape), np.uint8)
        return packet, self.bind_packet(packet, n, shape)

    def check_packet(self, packet: np.ndarray, out: np.ndarray):
        """Validate header and size of ``packet`` against ``out``; return the
        header as a dict of the fields of :data:`HEADER`."""
        if not isinstance(out, np.ndarray) or out.dtype != _F32 or out.ndim != 1 \
                or not out.flags.c_contiguous:
            raise TypeError(f"{self.name}: decode target must be a contiguous 1-D float32 array")
        return self.check_header(packet, out.size)

    def check_header(self, packet: np.ndarray, n: int, size: Optional[int] = None):
        """Validate the header and the size of ``packet`` (a host array) for
        ``n`` elements; return the header fields.  For a packet in device
        memory, ``packet`` is a host copy of its leading bytes (at least
        :data:`HEAD_BYTES`, or all of it) and ``size`` its size.  What lies in
        the payload (e.g. sparse indices) the decoders check."""
        size = packet.size if size is None else int(size)
        known = None
        if (type(self)._packet_size is Codec._packet_size and type(packet) is np.ndarray
                and packet.dtype == _U8 and packet.ndim == 1 and packet.size >= HEADER_SIZE):
            # the size rule reads the header alone: a header and size that
            # passed once pass again (a repeated call's packets)
            known = (packet[:HEADER_SIZE].tobytes(), size, n)
            passed = self.__dict__.setdefault("_passed", {})
            header = passed.get(known)
            if header is not None:
                return header
        header = self.parse_header(packet, n)
        expected = self._packet_size(packet, header)
        if size != expected:
            raise PacketError(f"{self.name}: packet is {size} bytes, its header implies "
                              f"{expected}")
        if known is not None:
            if len(passed) >= PASSED_HEADERS:
                passed.clear()
            passed[known] = header
        return header

    def parse_header(self, packet: np.ndarray, n: int):
        """The common header of ``packet`` for ``n`` elements, validated
        (magic, codec id, version, n) but not yet against the packet's size:
        :meth:`check_header` without its last step (a wrapper codec finds
        its inner packet's size this way)."""
        if not isinstance(packet, np.ndarray) or packet.dtype != _U8 or packet.ndim != 1:
            raise PacketError(f"{self.name}: a packet is a 1-D uint8 array")
        if packet.size < HEADER_SIZE:
            raise PacketError(f"{self.name}: packet of {packet.size} bytes is shorter than the "
                              f"{HEADER_SIZE}-byte header")
        header = dict(zip(_HEADER_FIELDS, _HEADER_STRUCT.unpack_from(packet)))
        if header["magic"] != MAGIC:
            raise PacketError(f"{self.name}: bad magic {header['magic']!r}")
        if int(header["codec"]) != self.codec_id:
            raise PacketError(f"{self.name}: packet is for codec id {int(header['codec'])}, "
                              f"expected {self.codec_id}")
        if int(header["version"]) != self.version:
            raise PacketError(f"{self.name}: packet format version {int(header['version'])} "
                              f"is not {self.version}")
        if int(header["n"]) != n:
            raise PacketError(f"{self.name}: packet holds {int(header['n'])} elements, "
                              f"target has {n}")
        return header


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------
#: codec ids in use by codecs that are not registered by name: the
#: ``rotate=True`` wrapper of :mod:`.rotation`
RESERVED_IDS = {13: "rotate"}


def _unique_id(cls: Type[Codec], registered: Dict[str, Type[Codec]]) -> None:
    if cls.codec_id in RESERVED_IDS:
        raise ValueError(f"codec id {cls.codec_id} is reserved for "
                         f"{RESERVED_IDS[cls.codec_id]!r}")
    for existing in registered.values():
        if existing.codec_id == cls.codec_id and existing is not cls and existing.name != cls.name:
            raise ValueError(f"codec id {cls.codec_id} is already taken by {existing.name!r}")


#: every codec, by name
CODECS = Registry("codec", check=_unique_id)
register_codec = CODECS.register
available_codecs = CODECS.names


def packet_codecs() -> Tuple[str, ...]:
    """The registered codecs that encode packets: all but those reduced by
    an algorithm of their own (``powersgd``), sorted."""
    return tuple(name for name, cls in CODECS.items() if cls.algorithm is None)

