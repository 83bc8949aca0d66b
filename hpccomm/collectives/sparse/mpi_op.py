"""``sparse_op``: a user-defined ``MPI_Op`` over a fixed-capacity sparse record.

The obvious way to reduce sparse vectors with MPI is a user-defined
reduction: ``MPI_Op_create(merge, commute=True)`` and ``MPI_Reduce``.  This
algorithm does exactly that -- to show what it costs.

Why a user-defined op cannot shrink messages.  MPI calls the op as
``merge(invec, inoutvec, len, datatype)``: it must combine ``len`` elements of
``datatype`` *in place*, and MPI moves ``len`` elements of ``datatype`` across
every edge of its reduction tree whatever they contain.  The datatype's size is
fixed before the reduction starts, identical on every rank, so it must be
large enough for the *largest* intermediate result -- the union at the root.
A leaf holding ``k`` non-zeros still sends the whole record: the bytes on
the wire follow the capacity, never the data.  Splitting a sparse stream over
several elements does not help either: MPI may cut a buffer of several elements
at any element boundary (pipelined and segmented reductions do), and an
element may not hold a variable-length piece of a stream.  Data-dependent
message sizes need point-to-point or ``v``-collectives, which is why
``sparse_rd``, ``sparse_split``, ``kylix`` and ``rle_pipeline`` exist.

The record.  One element of ``MPI.BYTE.Create_contiguous(R)`` (so MPI cannot
split it), little-endian::

    offset          size       field
    0               8          int64 count (pairs held; 0 when dense)
    8               8          int64 dense flag (0 sparse, 1 dense)
    16              C b        int32/int64 indices (b = 4/8 bytes)
    16 + C b        4 C        float32 values
    -- or, when dense --
    16              4 n        float32 values of the whole vector

Capacity: one ``MPI_Allreduce`` (SUM, int64) first gives the total ``K`` of
non-zeros over ranks, an upper bound of any union.  If ``K (b + 4) < 4 n``
the record holds ``C = K`` pairs and can never overflow.  Otherwise the
record is sized for the dense vector (``4 n`` payload bytes) and holds
``C = 4 n // (b + 4)`` pairs until a merge overflows that; the merged record
then switches to the dense form.  ``R = 16 + min(K (b + 4), 4 n)`` rounded up
to 8 bytes.

The merge (``record_merge`` in :mod:`hpccomm.kernels.merge`, a numba kernel
called from the Python callback that mpi4py runs under the GIL) is a sorted
merge-sum; every output value is one ``x + y`` or a copy and neither the union
nor the representation depends on operand order, so the op is bitwise
commutative.  Bit identity on every rank does not rely on that, though:
``MPI_Reduce`` to rank 0 and ``MPI_Bcast`` of the resulting record from it
(an ``MPI_Allreduce`` need not give every rank the same bits), and every rank
decodes the same bytes.  The op and the datatype are created per call and
freed in a ``finally`` (mpi4py keeps only a small, fixed number of live
Python user ops).

Cost: a binomial tree moves ``R`` bytes per edge in both the reduce and the
broadcast, so rank ``r`` sends and receives ``(children + [r != 0]) R`` bytes
-- up to ``2 log2(P) R`` at the root -- where ``R`` is sized for the final
union, not for each rank's ``k``.  For sparse inputs with little overlap
``R ~ P k (b + 4)``: every rank pays for all ranks' data, like
``sparse_allgather`` but with a log-depth chain of merges.  Once the union is
dense, ``R ~ 4 n``: a tree reduce + broadcast of dense data, about ``log2 P``
times the bytes of a bandwidth-optimal ``MPI_Allreduce``, plus a Python callback
per merge.  Byte counts are modelled from the binomial tree
(``call.modelled``); MPI's internal traffic cannot be observed.
"""
from __future__ import annotations

import numpy as np

from ...errors import PacketError
from ...kernels import merge as K
from ..base import register_algorithm
from .base import Part, SparseAlgorithm, check_indices, finish, index_dtype

HEADER_BYTES = 16


class RecordLayout:
    """Where things are in a record of capacity ``cap`` pairs."""

    def __init__(self, n: int, nnz_total: int, idt: np.dtype):
        self.n, self.idt = n, idt
        pair = idt.itemsize + 4
        if nnz_total * pair < 4 * n:
            self.cap, payload, self.dense_capable = nnz_total, nnz_total * pair, False
        else:
            self.cap, payload, self.dense_capable = 4 * n // pair, 4 * n, True
        self.nbytes = -(-(HEADER_BYTES + payload) // 8) * 8

    def views(self, rec: np.ndarray):
        """(header int64[2], indices, values, dense) views of one record."""
        ib = self.idt.itemsize
        cap = self.cap
        hdr = rec[:HEADER_BYTES].view(np.int64)
        idx = rec[HEADER_BYTES:HEADER_BYTES + cap * ib].view(self.idt)
        vals = rec[HEADER_BYTES + cap * ib:HEADER_BYTES + cap * (ib + 4)].view(np.float32)
        dense_len = self.n if self.dense_capable else 0
        dense = rec[HEADER_BYTES:HEADER_BYTES + 4 * dense_len].view(np.float32)
        return hdr, idx, vals, dense

    def fill(self, rec: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> None:
        """Write one rank's pairs into a zeroed record (dense if they exceed the capacity)."""
        hdr, r_idx, r_vals, dense = self.views(rec)
        if idx.size <= self.cap:
            hdr[0] = idx.size
            r_idx[:idx.size] = idx
            r_vals[:idx.size] = vals
        else:
            hdr[1] = 1
            dense[idx] = vals

    def check(self, hdr: np.ndarray, idx: np.ndarray) -> None:
        """Raise :class:`~hpccomm.errors.PacketError` unless a record's header
        and indices are ones :meth:`fill` and the merge can write."""
        flag, count = int(hdr[1]), int(hdr[0])
        if flag not in (0, 1) or (flag and not self.dense_capable) or \
                (not flag and not 0 <= count <= self.cap):
            raise PacketError(f"sparse_op: a record with header [{count}, {flag}] (capacity "
                              f"{self.cap}, dense {'allowed' if self.dense_capable else 'not allowed'})")
        if not flag:
            check_indices(idx[:count], 0, self.n, "sparse_op: record")

    def part(self, rec: np.ndarray) -> Part:
        hdr, idx, vals, dense = self.views(rec)
        self.check(hdr, idx)
        if hdr[1]:
            return Part(0, self.n, self.idt, dense=dense)
        count = int(hdr[0])
        return Part(0, self.n, self.idt, idx=idx[:count], vals=vals[:count])

    def merge_callback(self):
        """The Python function for ``MPI.Op.Create``: ``inout = in (+) inout``
        for each record of the buffers (aligned copies if MPI hands
        misaligned memory to the callback)."""
        size = self.nbytes

        def merge(inbuf, inoutbuf, datatype):
            a_all = np.frombuffer(inbuf, dtype=np.uint8)
            b_all = np.frombuffer(inoutbuf, dtype=np.uint8)
            for off in range(0, b_all.size, size):
                a = a_all[off:off + size]
                b = b_all[off:off + size]
                aligned = a.ctypes.data % 8 == 0 and b.ctypes.data % 8 == 0
                if not aligned:
                    a, b = a.copy(), b.copy()
                ha, ia, va, da = self.views(a)
                hb, ib, vb, db = self.views(b)
                self.check(ha, ia)
                self.check(hb, ib)
                K.record_merge(ha, ia, va, da, hb, ib, vb, db, self.cap)
                if not aligned:
                    b_all[off:off + size] = b

        return merge


@register_algorithm
class SparseOpReduce(SparseAlgorithm):
    name = "sparse_op"

    def reduce_sparse(self, idx, vals, n, state, net, out=None):
        P, call = self.size, net.call
        idt = index_dtype(n)
        total = np.array([idx.size], dtype=np.int64)
        if P > 1:
            net.allreduce(total)
        layout = RecordLayout(n, int(total[0]), idt)
        with call.time("encode"):
            rec = np.zeros(layout.nbytes, dtype=np.uint8)
            layout.fill(rec, idx, vals)
        result = net.reduce_bcast(rec, layout.merge_callback()) if P > 1 else rec
        part = layout.part(result)
        call.extra.update(record_bytes=layout.nbytes, capacity=layout.cap,
                          went_dense=part.is_dense)
        with call.time("decode"):
            return finish([part], out)
