"""``sparse_rd``: SparCML's sparse recursive doubling (SSAR_Recursive_double).

Every rank starts with its own contribution as one sparse stream over
``[0, n)`` (:class:`~hpccomm.collectives.sparse.base.Part`).  With
``p2 = 2**floor(log2 P)`` and ``rem = P - p2``:

1. **Fold** (only when ``P`` is not a power of two): among ranks
   ``0 .. 2 rem - 1``, each even rank sends its stream to the odd rank above
   it and sits out; the odd rank merges (even rank's stream as the left
   operand).  The ``p2`` remaining ranks get new ranks ``0 .. p2 - 1`` in
   the order of their real ranks.
2. **Rounds** ``t = 0 .. log2(p2) - 1``: exchange the whole current stream
   with the partner whose new rank differs in bit ``t`` and merge-sum, the
   lower real rank's stream always the left operand.  Once a merged stream's
   sparse form is not smaller than the dense one (density
   ``delta = 4 / (b + 4)``, 1/2 for int32 indices) it becomes dense and
   stays dense; later rounds exchange dense vectors (and merge dense with
   sparse where a partner is still sparse).
3. **Send-back**: each odd rank of the fold sends the final stream to the
   even rank below it.

Wire format per message: one int64 byte count (``Sendrecv``), then the
stream's payload (``Sendrecv``), sparse ``[indices | values]`` or dense
values, told apart by the length (see :mod:`.base`).

Bit identity: both partners of a round merge the *same two streams* in the
*same order* with the same (deterministic) kernel, so they leave the round
holding identical bytes; by induction the ``2**(t+1)`` ranks of every block
agree after round ``t``, all ``p2`` ranks agree at the end, and the folded
ranks receive a copy.

Cost (``k`` non-zeros per rank, ``b``-byte indices, no fill-in overlap):
``log2(p2) + 2 [rem > 0]`` message rounds (latency ``alpha`` each); round
``t`` moves ``min(2**t k (b + 4), 4 n)`` bytes each way, so the total is about
``(P - 1) k (b + 4)`` while sparse -- fill-in: the stream doubles every round
-- and ``4 n log2 P`` once dense.  Best for small ``P k``; for large data
``sparse_split`` moves fewer bytes.
"""
from ..base import register_algorithm
from .base import Part, SparseAlgorithm, finish, index_dtype


@register_algorithm
class SparseRecursiveDoubling(SparseAlgorithm):
    name = "sparse_rd"

    @staticmethod
    def _exchange(part: Part, peer: int, net) -> Part:
        """Send ``part`` to ``peer`` and return the part ``peer`` sent."""
        buf = net.sendrecv(part.payload(), peer, peer)
        return Part.from_payload(buf, part.lo, part.hi, part.idt)

    def reduce_sparse(self, idx, vals, n, state, net, out=None):
        P, r, call = self.size, self.rank, net.call
        idt = index_dtype(n)
        with call.time("encode"):
            part = Part.from_pairs(0, n, idt, idx, vals)
        p2 = 1 << (P.bit_length() - 1)
        rem = P - p2
        rounds = 0
        # 1. fold the first 2*rem ranks pairwise
        if r < 2 * rem:
            if r % 2 == 0:
                net.send(part.payload(), r + 1, 0)
                newrank = -1
            else:
                low = Part.from_payload(net.recv(r - 1, 0), 0, n, idt)
                with call.time("decode"):
                    part = low.merge(part)
                newrank = r // 2
        else:
            newrank = r - rem
        # 2. recursive doubling among the p2 active ranks
        if newrank >= 0:
            bit = 1
            while bit < p2:
                pn = newrank ^ bit
                peer = 2 * pn + 1 if pn < rem else pn + rem
                other = self._exchange(part, peer, net)
                with call.time("decode"):
                    part = part.merge(other) if r < peer else other.merge(part)
                bit <<= 1
                rounds += 1
        # 3. send the result back to the folded ranks
        if r < 2 * rem:
            if r % 2 == 1:
                net.send(part.payload(), r - 1, 1)
            else:
                part = Part.from_payload(net.recv(r + 1, 1), 0, n, idt)
        call.extra["rounds"] = rounds
        call.extra["went_dense"] = part.is_dense
        with call.time("decode"):
            return finish([part], out)
