"""``sparse_split``: SparCML's split-allgather (SSAR/DSAR_Split_allgather).

1. **Split**: ``[0, n)`` is cut into ``P`` contiguous ranges
   (:func:`~hpccomm.collectives.base.chunk_bounds`, the same on every rank);
   rank ``j`` owns range ``j``.  Each rank cuts its sorted pairs at the range
   boundaries and encodes each range as a stream
   (:class:`~hpccomm.collectives.sparse.base.Part`: sparse pairs, or dense
   values when those are not larger).
2. **Reduce-scatter**: byte counts by ``MPI_Alltoall`` (int64), the streams by
   ``MPI_Alltoallv``; the owner merge-sums the ``P`` streams of its range **in
   rank order** (:func:`~hpccomm.collectives.sparse.base.merge_parts`).
3. **Allgather**: each owner re-encodes its reduced range in whichever form
   is smaller -- sparse pairs (exact zeros dropped) or dense values; the
   payload length is the per-range flag -- and one ``MPI_Allgatherv`` (counts
   first) delivers every range to every rank, which decodes them in place.

Wire format: every payload is a stream as in :mod:`.base` --
``[int32/int64 global indices | float32 values]`` or ``float32`` values of the
whole range; counts are int64 bytes.

Bit identity: each range is summed by its owner alone; every rank, the owner
included, decodes the owner's gathered bytes.

Cost for ``k`` non-zeros per rank spread evenly, ``b``-byte indices:
step 2 sends ``(P-1)/P k (b + 4)`` bytes (or less where ranges go dense),
step 3 receives the other ranges, about ``(P-1)/P min(K (b + 4), 4 n)`` with
``K`` the non-zeros of the sum -- bounded by a dense reduce-scatter +
allgather (``2 (P-1)/P 4 n``) whatever the density; latency: three
collectives plus the count exchanges.  Skewed inputs (all mass in one range)
load one owner with everything; the bytes stay correct but that owner's
merge and its single range dominate.
"""
from ..base import chunk_bounds, register_algorithm
from .base import Part, SparseAlgorithm, finish, index_dtype, merge_parts, parts_for_ranges


@register_algorithm
class SparseSplitAllgather(SparseAlgorithm):
    name = "sparse_split"

    def boundaries(self, idx, n, net):
        """The ``P + 1`` range boundaries, identical on every rank: equal widths."""
        return [int(b) for b in chunk_bounds(n, self.size)]

    def reduce_sparse(self, idx, vals, n, state, net, out=None):
        P, r, call = self.size, self.rank, net.call
        idt = index_dtype(n)
        bounds = self.boundaries(idx, n, net)
        with call.time("encode"):
            sends = parts_for_ranges(idx, vals, bounds, idt)
        lo, hi = bounds[r], bounds[r + 1]
        if P == 1:
            owned = sends[0]
        else:
            received = net.alltoallv([p.payload() for p in sends])
            with call.time("decode"):
                streams = [sends[src] if src == r else Part.from_payload(received[src], lo, hi, idt)
                           for src in range(P)]
                owned = merge_parts(streams, lo, hi, idt)
        call.extra["dense_sends"] = sum(p.is_dense for p in sends)
        call.extra["owned_nnz"] = owned.nnz
        with call.time("encode"):
            owned = owned.smallest()
        if P == 1:
            ranges = [owned]
        else:
            gathered = net.allgatherv(owned.payload())
            with call.time("decode"):
                ranges = [Part.from_payload(gathered[j], bounds[j], bounds[j + 1], idt)
                          for j in range(P)]
        call.extra["dense_ranges"] = sum(p.is_dense for p in ranges)
        call.extra["went_dense"] = call.extra["dense_ranges"] > 0
        with call.time("decode"):
            return finish(ranges, out)
