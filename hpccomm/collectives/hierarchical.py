"""``hierarchical``: dense inside a node, compressed across nodes.

Ranks of one node share memory 10-100x faster than the network between
nodes, so the codec's loss and the kernels are spent only where the wire is
slow (S-Caffe's hierarchical reduce; ZeRO++'s qgZ).  With nodes of L_k ranks
and S = max_k L_k shares of the vector (``chunk_bounds(n, S)``), local rank i
of a node of L ranks owns shares {s : s mod L = i}:

1. **Reduce-scatter inside the node** (dense, exact in float32 order): every
   rank sends each owner the slices of its shares (one ``MPI_Alltoallv`` on
   the node communicator); the owner sums them in local-rank order.
2. **Across nodes, per share s in increasing order**: the owners of share s
   (one per node, ordered by node) run the ``outer`` algorithm with the
   reducer's codec on their node's partial sum -- error feedback, random
   streams and bit identity are the outer algorithm's, each share with its
   own residuals (saved in the key's state under ``share<s>/``) and its own
   seed.  Increasing s on every rank keeps the per-share collectives ordered.
3. **Allgather inside the node**: every owner's reduced shares to every rank
   of its node (``MPI_Allgatherv``).

Wire bytes across nodes: the outer algorithm's on n / S elements per owner,
instead of the flat algorithm's on n elements per rank.

Nodes: ``MPI_Comm_split_type(COMM_TYPE_SHARED)``, or ``nodes``: a node id per
rank (the same list on every rank; for tests and emulated clusters).  Nodes are
ordered by their lowest rank; local ranks follow global ranks.  Options:
``outer`` (default ``"twoshot"``), ``nodes``.  The dense step inside a node
carries no codec.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from ..state import KeyState
from .base import Algorithm, ReduceContext, chunk_bounds, get_algorithm_class, register_algorithm
from .transport import Transport


class _Layout:
    """The node structure of one communicator (made once, collectively)."""

    def __init__(self, comm: MPI.Comm, nodes: Optional[Sequence[int]]):
        rank = comm.Get_rank()
        if nodes is None:
            local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
            first = local.allreduce(rank, op=MPI.MIN)
            firsts = comm.allgather(first)
        else:
            ids = list(nodes)
            firsts = [min(r for r, h in enumerate(ids) if h == ids[q]) for q in range(len(ids))]
            local = comm.Split(firsts[rank], key=rank)
        order = sorted(set(firsts))
        self.node = order.index(firsts[rank])             #: this rank's node index
        self.local = local                                  #: the node's communicator
        self.L = local.Get_size()
        self.i = local.Get_rank()
        self.S = comm.allreduce(self.L, op=MPI.MAX)        #: shares of the vector
        self.owned = list(range(self.i, self.S, self.L))
        #: per share this rank owns: the communicator of that share's owners
        self.cross: Dict[int, MPI.Comm] = {}
        for s in range(self.S):
            sub = comm.Split(0 if s in self.owned else MPI.UNDEFINED, key=self.node)
            if sub != MPI.COMM_NULL:
                self.cross[s] = sub


@register_algorithm
class Hierarchical(Algorithm):
    name = "hierarchical"

    def __init__(self, comm, codec, outer: str = "twoshot", nodes: Optional[Sequence[int]] = None):
        super().__init__(comm, codec)
        if outer == "hierarchical":
            raise ValueError("hierarchical: outer must be another algorithm")
        self.outer_cls = get_algorithm_class(outer)
        self.outer = outer
        if nodes is not None:
            nodes = tuple(int(h) for h in nodes)
            if len(nodes) != self.size:
                raise ValueError(f"hierarchical: nodes lists {len(nodes)} ranks, the "
                                 f"communicator has {self.size}")
        self.nodes_option = nodes
        self.outer_cls(comm, codec)        # refuses a codec the outer algorithm cannot carry
        self._layout: Optional[_Layout] = None
        self._outer: Dict[int, Algorithm] = {}

    def params(self):
        return {"outer": self.outer, "nodes": "shared" if self.nodes_option is None
                else ".".join(map(str, self.nodes_option))}

    def _setup(self, comm: MPI.Comm) -> _Layout:
        if self._layout is None:
            self._layout = lay = _Layout(comm, self.nodes_option)
            self._outer = {s: self.outer_cls(c, self.codec) for s, c in lay.cross.items()}
        return self._layout

    def reduce(self, x: np.ndarray, out: np.ndarray, state: KeyState, ctx: ReduceContext) -> None:
        lay = self._setup(ctx.net.comm)
        n, S, L, call = x.size, lay.S, lay.L, ctx.call
        call.n = n
        b = chunk_bounds(n, S)
        # 1. reduce-scatter inside the node: owner j gets every rank's slices of its shares
        local = Transport(lay.local, call)
        mine = lay.owned
        # elements of the shares local rank j owns (shares j, j + L, ...)
        owned_len = [sum(int(b[s + 1] - b[s]) for s in range(j, S, L)) for j in range(L)]
        mine_len = owned_len[lay.i]
        packets: List[np.ndarray] = []
        for j in range(L):
            parts = [x[b[s]:b[s + 1]] for s in range(j, S, L)]
            packets.append(np.concatenate(parts).view(np.uint8) if parts
                           else np.empty(0, np.uint8))
        got = local.alltoallv(packets, [4 * mine_len] * L)
        partial = self.scratch("partial", mine_len)
        partial[...] = 0
        for src in range(L):
            partial += got[src].view(np.float32)
        # 2. across nodes, one share at a time, in increasing order
        reduced = self.scratch("reduced", mine_len)
        off = 0
        for s in mine:
            m = int(b[s + 1] - b[s])
            sub = self._share_state(state, s)
            sctx = ReduceContext(net=Transport(lay.cross[s], call), memory=ctx.memory,
                                 seed=ctx.seed * 1_000_003 + s, step=ctx.step, shape=(m,),
                                 key=ctx.key, fused=ctx.fused, finite=ctx.finite)
            self._outer[s].reduce(partial[off:off + m], reduced[off:off + m], sub, sctx)
            self._keep_share_state(state, s, sub)
            off += m
        # 3. allgather inside the node
        whole = local.allgatherv(reduced.view(np.uint8), [4 * m for m in owned_len])
        for j in range(L):
            data, pos = whole[j].view(np.float32), 0
            for s in range(j, S, L):
                m = int(b[s + 1] - b[s])
                out[b[s]:b[s + 1]] = data[pos:pos + m]
                pos += m

    # the residuals of each share live in the key's state (saved by state_dict)
    @staticmethod
    def _share_state(state: KeyState, s: int) -> KeyState:
        subs = state.cache.setdefault("hierarchical", {})
        sub = subs.get(s)
        if sub is None:
            sub = subs[s] = KeyState()
        prefix = f"share{s}/"
        sub.residuals = {k[len(prefix):]: v for k, v in state.residuals.items()
                         if k.startswith(prefix)}
        sub.step = state.step
        return sub

    @staticmethod
    def _keep_share_state(state: KeyState, s: int, sub: KeyState) -> None:
        prefix = f"share{s}/"
        for k, v in sub.residuals.items():
            state.residuals[prefix + k] = v
