"""Shared machinery of the sparse allreduce algorithms.

Every sparse algorithm is a :class:`SparseAlgorithm`: its core,
:meth:`SparseAlgorithm.reduce_sparse`, works on this rank's contribution as a
pair of arrays ``(idx, vals)`` -- strictly increasing global indices (int32
when ``n < 2**31``, int64 otherwise; :func:`index_dtype`) and float32 values --
and either writes the dense sum into ``out`` or returns the non-zero entries
of the sum as ``(idx, vals)``.  The two entry points share that core:

* :class:`~hpccomm.Allreducer` hands the algorithm a dense ``x``;
  :meth:`SparseAlgorithm.reduce` adds the worker residual
  (``v = x + e``), takes the sparse contribution from the codec
  (:func:`sparsify`), runs the core and stores ``e = v - densify(idx, vals)``;
* :func:`hpccomm.sparse_allreduce` hands it a
  :class:`~hpccomm.SparseVector`'s arrays directly.

Sparse streams (SparCML)
------------------------
A :class:`Part` is a piece of a vector over an index range ``[lo, hi)``, held
either sparse (``idx``, ``vals``) or dense (``hi - lo`` float32 values).  On
the wire a part is one byte string, and its **length says which**::

    dense:   4 (hi - lo) bytes   float32 values, little-endian
    sparse:  nnz (b + 4) bytes   nnz indices (int32/int64, b = 4/8 bytes,
                                 global, increasing), then nnz float32 values

A part goes dense as soon as its sparse form would not be smaller, i.e. when
``nnz (b + 4) >= 4 (hi - lo)`` -- a density of ``delta = 4 / (b + 4)`` (1/2
for int32 indices) -- so a sparse payload is always strictly shorter than the
dense one and no flag byte is needed.  Counts travel before the data
(an int64 byte count per message).

Summation order
---------------
Merges take a fixed left operand (:meth:`Part.merge`) and the many-way merge
(:func:`merge_parts`) sums in the order given (rank order); each algorithm
documents why this leaves every rank with the same bits.

Statistics
----------
Bytes are counted by the transport (:mod:`.transport`), per message at the
MPI call boundary (counts included), in ``call.bytes_sent`` /
``call.bytes_recv`` -- modelled where MPI moves data internally (allgathers,
the agreement allreduces, ``sparse_op``'s tree; ``call.modelled``).
Time goes to ``call.t_encode`` (building streams, routing tables),
``t_comm`` (MPI calls) and ``t_decode`` (merging, writing the result).
``call.extra["went_dense"]`` says whether the result travelled (at least
partly) in dense form -- the same on every rank; the dense entry point adds
``extra["nnz"]``, this rank's number of pairs.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
from ...errors import PacketError
from ...kernels import merge as K
from ..base import Algorithm
from ..transport import Transport

VALUE_BYTES = 4


def index_dtype(n: int) -> np.dtype:
    """int32 indices for vectors shorter than 2**31, int64 beyond."""
    return np.dtype(np.int32) if n < 2 ** 31 else np.dtype(np.int64)


def goes_dense(nnz: int, length: int, idx_bytes: int) -> bool:
    """The density switch: dense once the sparse form is not smaller."""
    return nnz * (idx_bytes + VALUE_BYTES) >= VALUE_BYTES * length


def check_indices(idx: np.ndarray, lo: int, hi: int, what: str) -> None:
    """Raise :class:`~hpccomm.errors.PacketError` unless the indices ``idx``
    received from another rank are strictly increasing inside ``[lo, hi)``
    (the kernels that scatter them check nothing)."""
    bad = K.first_unordered(idx, lo, hi)
    if bad >= 0:
        prev = f" after {int(idx[bad - 1])}" if bad else ""
        raise PacketError(f"{what}: index {int(idx[bad])} at position {bad}{prev} is not "
                          f"increasing inside [{lo}, {hi})")


class Part:
    """A sparse-or-dense piece of a vector over ``[lo, hi)``.

    Sparse: ``idx`` (increasing, global) and ``vals``; ``dense`` is ``None``.
    Dense: ``dense`` holds ``hi - lo`` values; ``idx``/``vals`` are ``None``.
    """

    __slots__ = ("lo", "hi", "idx", "vals", "dense", "idt")

    def __init__(self, lo: int, hi: int, idt: np.dtype, idx=None, vals=None, dense=None):
        self.lo, self.hi, self.idt = int(lo), int(hi), idt
        self.idx, self.vals, self.dense = idx, vals, dense

    # -- construction -----------------------------------------------------
    @classmethod
    def from_pairs(cls, lo, hi, idt, idx, vals) -> "Part":
        """A part from sorted pairs inside the range, in its smaller form."""
        part = cls(lo, hi, idt, idx=idx, vals=vals)
        return part.normalized()

    @classmethod
    def from_payload(cls, buf: np.ndarray, lo: int, hi: int, idt: np.dtype) -> "Part":
        """Decode a wire payload (see the module docstring)."""
        length = hi - lo
        size = int(buf.size)
        if size == VALUE_BYTES * length:
            return cls(lo, hi, idt, dense=_aligned(buf, np.float32))
        pair = idt.itemsize + VALUE_BYTES
        if size % pair or size > VALUE_BYTES * length:
            raise PacketError(f"sparse payload of {size} bytes for a range of {length} elements "
                              f"is neither dense ({VALUE_BYTES * length} bytes) nor whole "
                              f"{pair}-byte pairs")
        nnz = size // pair
        cut = nnz * idt.itemsize
        idx = _aligned(buf[:cut], idt)
        check_indices(idx, lo, hi, "sparse payload")
        return cls(lo, hi, idt, idx=idx, vals=_aligned(buf[cut:], np.float32))

    # -- properties -------------------------------------------------------
    @property
    def is_dense(self) -> bool:
        return self.dense is not None

    @property
    def length(self) -> int:
        return self.hi - self.lo

    @property
    def nnz(self) -> int:
        """Stored entries (every element when dense)."""
        return self.length if self.is_dense else int(self.idx.size)

    @property
    def wire_bytes(self) -> int:
        if self.is_dense:
            return VALUE_BYTES * self.length
        return int(self.idx.size) * (self.idt.itemsize + VALUE_BYTES)

    # -- conversions ------------------------------------------------------
    def normalized(self) -> "Part":
        """This part, dense if the sparse form is not smaller (sparse -> dense only)."""
        if not self.is_dense and goes_dense(self.idx.size, self.length, self.idt.itemsize):
            return Part(self.lo, self.hi, self.idt,
                        dense=K.densify(self.idx, self.vals, self.lo, self.hi))
        return self

    def smallest(self) -> "Part":
        """This part in whichever form is smaller on the wire (dense parts
        whose non-zeros are few enough become sparse, dropping zeros)."""
        if self.is_dense:
            count = int(np.count_nonzero(self.dense))
            if not goes_dense(count, self.length, self.idt.itemsize):
                idx, vals = K.nonzeros(self.dense, self.lo, np.zeros(1, self.idt))
                return Part(self.lo, self.hi, self.idt, idx=idx, vals=vals)
            return self
        return self.normalized()

    def payload(self) -> np.ndarray:
        """The wire bytes (``uint8``)."""
        if self.is_dense:
            return self.dense.view(np.uint8)
        return np.concatenate([self.idx.view(np.uint8), self.vals.view(np.uint8)])

    def write_into(self, out: np.ndarray) -> None:
        """Overwrite ``out[lo:hi]`` with this part's values."""
        if self.is_dense:
            out[self.lo:self.hi] = self.dense
        else:
            window = out[self.lo:self.hi]
            window[...] = 0
            K.scatter_set(window, self.idx, self.vals, self.lo)

    def add_into(self, acc: np.ndarray) -> None:
        """``acc += part`` where ``acc`` covers ``[lo, hi)`` (``acc`` left operand)."""
        if self.is_dense:
            acc += self.dense
        else:
            K.scatter_add(acc, self.idx, self.vals, self.lo)

    def nonzero_pairs(self) -> Tuple[np.ndarray, np.ndarray]:
        """``(idx, vals)`` of the entries whose value is not 0.0."""
        if self.is_dense:
            return K.nonzeros(self.dense, self.lo, np.zeros(1, self.idt))
        return K.drop_zeros(self.idx, self.vals)

    # -- merging ----------------------------------------------------------
    def merge(self, other: "Part") -> "Part":
        """``self + other`` over the same range, ``self`` the left operand
        wherever both hold a value; the result is normalized.  Dense + sparse
        adds the sparse values into a copy of the dense array, which equals
        ``self + other`` bitwise because float addition is commutative."""
        lo, hi, idt = self.lo, self.hi, self.idt
        if self.is_dense and other.is_dense:
            return Part(lo, hi, idt, dense=self.dense + other.dense)
        if self.is_dense or other.is_dense:
            dense, sparse = (self, other) if self.is_dense else (other, self)
            acc = dense.dense.copy()
            K.scatter_add(acc, sparse.idx, sparse.vals, lo)
            return Part(lo, hi, idt, dense=acc)
        idx, vals = K.merge_sum(self.idx, self.vals, other.idx, other.vals)
        return Part(lo, hi, idt, idx=idx, vals=vals).normalized()


def merge_parts(parts: Sequence[Part], lo: int, hi: int, idt: np.dtype) -> Part:
    """Sum ``parts`` (all over ``[lo, hi)``) in the order given.

    Dense accumulation (``0 + p0 + p1 + ...``) when any part is dense or the
    pairs together would not be smaller than the dense range; otherwise the
    pairs are concatenated, stably sorted by index and coalesced, which sums
    each index's values in the same order.  The result is normalized."""
    length = hi - lo
    total = sum(p.nnz for p in parts)
    if any(p.is_dense for p in parts) or goes_dense(total, length, idt.itemsize):
        acc = np.zeros(length, dtype=np.float32)
        for p in parts:
            p.add_into(acc)
        return Part(lo, hi, idt, dense=acc)
    nonempty = [p for p in parts if p.nnz]
    if not nonempty:
        return Part(lo, hi, idt, idx=np.empty(0, idt), vals=np.empty(0, np.float32))
    if len(nonempty) == 1:
        return Part(lo, hi, idt, idx=nonempty[0].idx, vals=nonempty[0].vals)
    idx = np.concatenate([p.idx for p in nonempty])
    vals = np.concatenate([p.vals for p in nonempty])
    order = np.argsort(idx, kind="stable")
    idx, vals = K.coalesce_sorted(idx[order], vals[order])
    return Part(lo, hi, idt, idx=idx, vals=vals).normalized()


def finish(parts: Sequence[Part], out: Optional[np.ndarray]):
    """Deliver disjoint, ordered ``parts`` (at least one): into ``out``
    (dense), or as the concatenated non-zero pairs when ``out`` is None."""
    if out is not None:
        for p in parts:
            p.write_into(out)
        return None
    pairs = [p.nonzero_pairs() for p in parts]
    return np.concatenate([i for i, _ in pairs]), np.concatenate([v for _, v in pairs])


def _aligned(buf: np.ndarray, dtype) -> np.ndarray:
    """``buf`` (uint8) viewed as ``dtype``, copied when misaligned."""
    arr = buf.view(dtype)
    return arr if arr.flags.aligned else arr.copy()


def sparsify(codec, v: np.ndarray, ectx) -> Tuple[np.ndarray, np.ndarray]:
    """This rank's sparse contribution ``(idx, vals)`` to the sum of ``v``.

    A codec with a ``sparsify(v, ctx) -> (indices, values)`` method supplies
    the pairs itself (they are checked: increasing and inside ``[0, n)``).
    Otherwise the pairs are the non-zeros of ``decode(encode(v))`` -- for a
    lossless codec that is ``v`` itself, so codec ``"none"`` sends the input's
    non-zeros as they are."""
    n = v.size
    idt = index_dtype(n)
    method = getattr(codec, "sparsify", None)
    if method is not None:
        idx, vals = method(v, ectx)
        idx = np.ascontiguousarray(idx, dtype=idt)
        vals = np.ascontiguousarray(vals, dtype=np.float32)
        if idx.shape != vals.shape or idx.ndim != 1:
            raise PacketError(f"codec {codec.name!r}: sparsify returned {idx.shape} indices and "
                              f"{vals.shape} values")
        if idx.size and (idx[0] < 0 or idx[-1] >= n or (idx.size > 1 and
                                                         not np.all(idx[1:] > idx[:-1]))):
            raise PacketError(f"codec {codec.name!r}: sparsify returned indices that are not "
                              f"increasing inside [0, {n})")
        return idx, vals
    if codec.lossless:
        decoded = v
    else:
        decoded = codec.decode(codec.encode(v, ectx), np.empty(n, dtype=np.float32))
    return K.nonzeros(decoded, 0, np.zeros(1, idt))


class SparseAlgorithm(Algorithm):
    """Base class of the sparse allreduce algorithms (see the module docstring).

    Subclasses implement :meth:`reduce_sparse`.  Every rank must call it with
    the same ``n``; the caller has validated ``idx`` (increasing, inside
    ``[0, n)``, dtype :func:`index_dtype`) and ``vals`` (float32)."""

    def check_codec(self, codec):
        if codec.dense:
            raise ValueError(f"algorithm {self.name!r} sends (index, value) pairs: it takes a "
                             f"sparsifying codec (topk, randk, dgc, threshold, adaptive) or "
                             f"'none' for input that is already sparse; {codec.name!r} encodes "
                             f"every element (try 'twoshot' or 'allgather')")

    def exchange(self, work, out, state, ctx):
        call = ctx.call
        with call.time("encode"):
            ectx = work.context(ctx.encode_context(self.rank))
            idx, vals = sparsify(self.codec, work.v, ectx)
        call.extra["nnz"] = int(idx.size)
        self.reduce_sparse(idx, vals, work.x.size, state, ctx.net, out)
        work.sent_pairs(idx, vals)

    def reduce_sparse(self, idx: np.ndarray, vals: np.ndarray, n: int, state, net: Transport,
                      out: Optional[np.ndarray] = None):
        """Sum the ranks' sparse vectors of length ``n``; every MPI call goes
        through ``net`` (whose ``call`` takes the statistics).

        With ``out`` (float32, length ``n``): write the dense sum there and
        return None.  Without: return ``(idx, vals)``, the entries of the sum
        whose value is not 0.0, sorted.  Identical bits on every rank."""
        raise NotImplementedError


def cut_positions(idx: np.ndarray, bounds: Sequence[int]) -> np.ndarray:
    """Positions cutting sorted ``idx`` at the range boundaries ``bounds``."""
    return np.searchsorted(idx, np.asarray(bounds, dtype=np.int64))


def parts_for_ranges(idx, vals, bounds, idt) -> List[Part]:
    """One normalized part per range ``[bounds[j], bounds[j+1])``."""
    cuts = cut_positions(idx, bounds)
    return [Part.from_pairs(bounds[j], bounds[j + 1], idt, idx[cuts[j]:cuts[j + 1]],
                            vals[cuts[j]:cuts[j + 1]]) for j in range(len(bounds) - 1)]
