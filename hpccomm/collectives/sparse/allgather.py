"""``sparse_allgather``: every rank's (index, value) pairs to every rank.

Each rank encodes its whole contribution as one stream over ``[0, n)``
(:class:`~hpccomm.collectives.sparse.base.Part`: ``[int32/int64 indices |
float32 values]``, or the dense float32 vector when that is not larger); one
``MPI_Allgather`` of the int64 byte counts and one ``MPI_Allgatherv`` deliver
all ``P`` streams to everyone.  Every rank then sums them **in rank order**:
scatter-add into a zeroed dense result, or -- for a sparse result -- a stable
sort by index and a left-to-right coalesce, which sums each index in the same
rank order.  Every rank runs the same deterministic sum on the same bytes, so
every rank holds the same bits.

Cost: each rank receives ``sum_{j != r} k_j (b + 4)`` bytes (``k_j``
non-zeros of rank ``j``, ``b``-byte indices) and does ``O(sum k_j)`` work --
growing with ``P``.  The simplest choice for tiny ``P k``; crossover with a
dense ring allreduce near ``P k (b + 4) ~ 8 n``.
"""
from ..base import register_algorithm
from .base import Part, SparseAlgorithm, finish, index_dtype, merge_parts


@register_algorithm
class SparseAllgather(SparseAlgorithm):
    name = "sparse_allgather"

    def reduce_sparse(self, idx, vals, n, state, net, out=None):
        P, call = self.size, net.call
        idt = index_dtype(n)
        with call.time("encode"):
            mine = Part.from_pairs(0, n, idt, idx, vals)
        if P == 1:
            streams = [mine]
        else:
            gathered = net.allgatherv(mine.payload())
            with call.time("decode"):
                streams = [Part.from_payload(gathered[j], 0, n, idt) for j in range(P)]
        call.extra["went_dense"] = any(p.is_dense for p in streams)
        with call.time("decode"):
            if out is not None:
                out[...] = 0
                for p in streams:  # rank order
                    p.add_into(out)
                return None
            return finish([merge_parts(streams, 0, n, idt)], None)
