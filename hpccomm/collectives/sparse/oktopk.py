"""``oktopk``: Ok-Topk's balanced split-and-reduce (Li & Hoefler, PPoPP'22).

``sparse_split`` cuts the index space into ``P`` ranges of equal *width*; with
skewed inputs (all mass in a few ranges, as top-k selections of real
gradients often are) one owner receives and merges almost everything.
Ok-Topk cuts it into ranges of (nearly) equal *load* instead:

1. **Repartition**: every rank with ``k > 0`` non-zeros takes the ``P - 1``
   quantile indices of its sorted index set, ``idx[(j k) // P]`` for
   ``j = 1 .. P-1``; one ``MPI_Allreduce`` (SUM, int64 ``[non-empty flag,
   q_1 .. q_{P-1}]``) gives their sum, and boundary ``j`` is that sum divided
   (floor) by the number of non-empty ranks.  Integer sums make the
   boundaries identical on every rank; they are non-decreasing because every
   rank's quantiles are.  Ranks without non-zeros do not vote (with ``nnz <
   P`` the repeated quantiles are fine) -- the reference divides by ``P`` and
   fails there.  When no rank has non-zeros, or ``P n`` could overflow int64,
   the ranges have equal widths.
2. **Split and reduce / allgather**: exactly as ``sparse_split`` (counts by
   ``MPI_Alltoall``, streams by ``MPI_Alltoallv``, owner merge-sum in rank
   order, ``MPI_Allgatherv`` of the reduced ranges, each sparse or dense),
   over the balanced ranges; wire format and bit identity as there.

Differences from the reference: the repartition runs on every call instead
of every 64 iterations (deciding alike on every rank whether to reuse old
boundaries would itself take an allreduce of the same size), and the global
top-k re-selection of Ok-Topk's second phase is left out -- this collective
returns the exact sum; pair it with the ``topk`` codec and error feedback for
Ok-Topk's lossy scheme.

Cost: ``sparse_split``'s plus one ``8 P``-byte allreduce; for inputs spread
evenly over the index space the ranges come out near equal widths, for
skewed inputs each owner gets about ``1/P`` of the pairs instead of all.
"""
import numpy as np

from ..base import chunk_bounds, register_algorithm
from .split_allgather import SparseSplitAllgather

_INT64_MAX = 2 ** 63 - 1


@register_algorithm
class OkTopkSplit(SparseSplitAllgather):
    name = "oktopk"

    def boundaries(self, idx, n, net):
        P = self.size
        if P == 1 or P * n > _INT64_MAX:
            return [int(b) for b in chunk_bounds(n, P)]
        k = idx.size
        votes = np.zeros(P, dtype=np.int64)
        if k:
            votes[0] = 1
            votes[1:] = idx[(np.arange(1, P) * k) // P]
        net.allreduce(votes)
        voters = int(votes[0])
        if voters == 0:
            return [int(b) for b in chunk_bounds(n, P)]
        return [0] + [int(v) // voters for v in votes[1:]] + [n]
