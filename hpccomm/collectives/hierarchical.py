"""``hierarchical``: dense inside a node, compressed across nodes.

Ranks of one node share memory 10-100x faster than the network between
nodes, so the codec's loss and the kernels are spent only where the wire is
slow (S-Caffe's hierarchical reduce; ZeRO++'s qgZ).  With nodes of L_k ranks
and S = max_k L_k shares of the vector (``chunk_bounds(n, S)``), local rank i
of a node of L ranks owns shares {s : s mod L = i}:

1. **Reduce-scatter inside the node**, through a block of memory the node's
   ranks share (two float32 segments of n per rank, see
   :meth:`_Layout.segments`): every rank copies the shares others own into
   its segment; a barrier on the node; each owner sums its shares in
   local-rank order (its own slice read from its input, no copy).
2. **Across nodes, per share s in increasing order**: the owners of share s
   (one per node, ordered by node) run the ``outer`` algorithm with the
   reducer's codec on their node's sum -- error feedback, random streams and
   bit identity are the outer algorithm's, each share with its own residuals
   (saved in the key's state under ``share<s>/``) and its own seed.
   Increasing s on every rank keeps the per-share collectives ordered.  The
   owner writes the result into ``out`` and its segment.
3. **Allgather inside the node**: a barrier on the node, then every rank
   copies the other owners' results from their segments into ``out``.

Passes over memory per rank (n elements, L ranks per node): (L-1)/L n copied
in, n/L x L read for the sum, the outer algorithm on n/L, n/L copied to the
segment, (L-1)/L n copied out -- no MPI messages inside the node, and two
barriers.  Consecutive calls use alternate segments, so no closing barrier is
needed: a rank cannot write a segment again before every rank of its node
has passed the next call's first barrier, i.e. finished reading this call's.

Wire bytes across nodes: the outer algorithm's on n / S elements per owner,
instead of the flat algorithm's on n elements per rank.

Nodes: ``MPI_Comm_split_type(COMM_TYPE_SHARED)``, or ``nodes``: a node id per
rank (the same list on every rank; for tests and emulated clusters; the ranks
given one node must share memory, else a ``ValueError`` on every rank).  Nodes
are ordered by their lowest rank; local ranks follow global ranks.  The layout
(node and per-share communicators, the shared block) is made on the first
call and cached on the communicator until it is freed; every call records
what was found in ``stats.last.extra`` (``nodes``, and ``ranks_per_node`` of
this rank's node), so a run can show that it spanned the nodes it should.
Options:
``outer`` (default ``"twoshot"``), ``nodes``.  The dense step inside a node
carries no codec.
"""
from __future__ import annotations

import mmap
import os
import tempfile
from typing import Dict, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from .. import handles
from ..communicators import comm_cache
from ..state import KeyState
from ..validation import everywhere
from .base import Algorithm, ReduceContext, chunk_bounds, get_algorithm_class, register_algorithm
from .transport import Transport


class _Layout:
    """The node structure of one communicator (made once, collectively, and
    shared by every ``hierarchical`` reducer on that communicator: their
    calls are ordered on it)."""

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
        shm = local.Split_type(MPI.COMM_TYPE_SHARED)
        shared = comm.allreduce(shm.Get_size() == local.Get_size(), op=MPI.LAND)
        shm.Free()
        if not shared:
            local.Free()
            raise everywhere(ValueError("hierarchical: the ranks of a node must share memory "
                                        "(nodes= groups ranks of different hosts)"))
        order = sorted(set(firsts))
        self.nodes = len(order)                            #: nodes found
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
        handles.made("comm", 1 + len(self.cross))     # local and cross: kept until release()
        self._segments: List[np.ndarray] = []
        self._capacity = 0
        self._calls = 0

    def segments(self, comm: MPI.Comm, n: int) -> Optional[List[np.ndarray]]:
        """Every local rank's segment of ``n`` float32 for this call, in one
        block of memory shared by the node (None on a node of one rank).  The
        block holds two segments per rank, used by alternate calls, so a rank
        that leaves a call early cannot overwrite what a slower rank still
        reads.  It grows when ``n`` outgrows it: every rank makes the same
        calls, so every rank grows it in the same call, and a failure (no
        room in ``/dev/shm``) is raised on every rank of ``comm``."""
        if n > self._capacity:
            self._segments, block, err = [], None, None
            if self.L > 1:
                try:
                    block = shared_block(self.local, 2 * self.L * n * 4)
                except OSError as exc:
                    err = str(exc)
            errs = [e for e in comm.allgather(err) if e is not None]
            if errs:
                self._capacity = 0
                raise everywhere(MemoryError(f"hierarchical: no shared memory for {n} "
                                             f"elements per rank on a node: {errs[0]}"))
            if block is not None:     # the views keep the mapping alive
                whole = np.frombuffer(block, dtype=np.float32)
                self._segments = [whole[j * 2 * n:(j + 1) * 2 * n] for j in range(self.L)]
            self._capacity = n
        if not self._segments:
            return None
        half = self._calls % 2
        self._calls += 1
        lo = half * self._capacity
        return [seg[lo:lo + n] for seg in self._segments]

    def release(self) -> None:
        """Free the node's communicators and unmap the block (when the
        communicator it was made for is freed)."""
        self._segments, self._capacity = [], 0
        for c in [self.local, *self.cross.values()]:
            c.Free()
        handles.freed("comm", 1 + len(self.cross))
        self.cross = {}

    def fence(self) -> None:
        """Every rank of the node has finished writing its segment (MPI's
        barrier orders the memory accesses around it)."""
        self.local.Barrier()


def shared_block(local: MPI.Comm, nbytes: int) -> mmap.mmap:
    """``nbytes`` of memory mapped by every rank of ``local`` (ranks of one
    host): a file in ``/dev/shm`` made by local rank 0, reserved with
    ``posix_fallocate`` (so a full tmpfs fails here, not with SIGBUS later),
    mapped by all, then unlinked -- the memory goes when the last mapping
    does, and nothing is left behind if a rank dies.  Collective on ``local``;
    an ``OSError`` is raised on every rank of ``local``."""
    name, err = None, None
    if local.Get_rank() == 0:
        try:
            fd, name = tempfile.mkstemp(prefix="hpccomm-", dir=_SHM_DIR)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
        except OSError as exc:
            err = str(exc)
    name, err = local.bcast((name, err), root=0)
    block = None
    try:
        if err is None:
            with open(name, "r+b") as f:
                block = mmap.mmap(f.fileno(), nbytes)
    except OSError as exc:
        err = str(exc)
    errs = [e for e in local.allgather(err) if e is not None]
    if local.Get_rank() == 0 and name is not None:
        os.unlink(name)
    if errs:
        raise OSError(errs[0])
    return block


_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


def node_layout(comm: MPI.Comm, nodes: Optional[Sequence[int]]) -> _Layout:
    """The layout of ``comm`` (cached on it until it is freed)."""
    cache = comm_cache(comm)
    lay = cache.get(("hierarchical", nodes))
    if lay is None:
        lay = cache[("hierarchical", nodes)] = _Layout(comm, nodes)
    return lay


@register_algorithm
class Hierarchical(Algorithm):
    name = "hierarchical"

    encodes_sums = True

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
        self._probe = self.outer_cls(comm, codec)   # refuses a codec the outer cannot carry
        self._layout: Optional[_Layout] = None
        self._outer: Dict[int, Algorithm] = {}

    def check_memory(self, memory):
        self._probe.check_memory(memory)

    def params(self):
        return {"outer": self.outer, "nodes": "shared" if self.nodes_option is None
                else ".".join(map(str, self.nodes_option))}

    def _setup(self, comm: MPI.Comm) -> _Layout:
        if self._layout is None:
            self._layout = lay = node_layout(comm, self.nodes_option)
            self._outer = {s: self.outer_cls(c, self.codec) for s, c in lay.cross.items()}
        return self._layout

    def reduce(self, x: np.ndarray, out: np.ndarray, state: KeyState, ctx: ReduceContext) -> None:
        lay = self._setup(ctx.net.comm)
        n, S, L = x.size, lay.S, lay.L
        ctx.call.n = n
        ctx.call.extra.update(nodes=lay.nodes, ranks_per_node=L)
        b = chunk_bounds(n, S)
        shares = [slice(int(b[s]), int(b[s + 1])) for s in range(S)]
        seg = lay.segments(ctx.net.comm, n) if n else None
        # 1. reduce-scatter inside the node: the shares others own, into this rank's segment
        if seg is not None:
            me = seg[lay.i]
            for s in range(S):
                if s % L != lay.i:
                    me[shares[s]] = x[shares[s]]
            lay.fence()
        # 2. across nodes, per owned share in increasing order, on the node's sum
        for s in lay.owned:
            sh = shares[s]
            if seg is None:
                partial = x[sh]
            else:   # local ranks in order; this rank's own slice read from x
                parts = [x[sh] if j == lay.i else seg[j][sh] for j in range(L)]
                partial = self.scratch("partial", sh.stop - sh.start)
                np.add(parts[0], parts[1], out=partial)
                for p in parts[2:]:
                    partial += p
            sub = self._share_state(state, s)
            sctx = ReduceContext(net=Transport(lay.cross[s], ctx.call), memory=ctx.memory,
                                 seed=ctx.seed * 1_000_003 + s, step=ctx.step,
                                 shape=(sh.stop - sh.start,), key=ctx.key, fused=ctx.fused,
                                 finite=ctx.finite)
            self._outer[s].reduce(partial, out[sh], sub, sctx)
            self._keep_share_state(state, s, sub)
            if seg is not None:
                seg[lay.i][sh] = out[sh]
        # 3. allgather inside the node: the other owners' results from their segments
        if seg is not None:
            lay.fence()
            for s in range(S):
                if s % L != lay.i:
                    out[shares[s]] = seg[s % L][shares[s]]

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
