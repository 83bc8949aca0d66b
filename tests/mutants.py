"""Deliberately broken variants of hpccomm's parts, for showing that the
suite's checks can fail (``test_mutants_mpi.py`` runs each through the checks
that must catch it).

Each mutant is a subclass of the real part with one thing broken, built on
demand; nothing in the library is patched.  Algorithms are registered only
inside :func:`registered` (the registry is global: a sparse algorithm left
registered would join ``hpccomm.sparse_algorithms()``).

=====================  ==========================================================
zero decoder           every codec: packets decode to zeros (fused paths off, so
                       nothing bypasses the decoder); sparse pairs and summable
                       sums too
swapped means          onebit, adaptive: ``mu_pos`` and ``mu_neg`` exchanged on decode
dropped residual       the residual memory keeps nothing (``e = 0`` every call)
dropped owner residual the owner's re-encode in twoshot keeps nothing
wrong owner order      twoshot: the owner sums the packets in reverse rank order
skipped rank           the last rank's contribution never reaches the sum: twoshot's
                       owners, allgather's decode, the summed codes, mpi's and
                       auto's dense sum, the sparse algorithms' pairs,
                       hierarchical's node segment
=====================  ==========================================================
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np

from hpccomm.codecs.base import CODECS, HEADER_SIZE, EncodeContext
from hpccomm.collectives.base import ALGORITHMS
from hpccomm.memory import ResidualMemory

MUTANT = "test-mutant"


# ---------------------------------------------------------------------------
# codecs
# ---------------------------------------------------------------------------
class ZeroDecoder:
    """Mixin: every decoded value is zero."""

    encode_with_feedback = None     # the fused paths would not go through the decoder
    owner_step = None
    decode_sum = None               # (allgather's sum of packets, ebq)

    def _decode_into(self, packet, header, out, add):
        if not add:
            out[:] = 0

    def _zero_pairs(self, x, ctx=EncodeContext()):
        idx, vals = type(self).__mro__[2].sparsify(self, x, ctx)
        return idx, np.zeros_like(vals)

    def from_summable(self, total, scale, out, add=False):
        super().from_summable(total, scale, np.empty_like(out))    # its checks
        if not add:
            out[:] = 0
        return out


class SwappedMeans:
    """Mixin for onebit and adaptive: a packet's ``mu_pos`` and ``mu_neg``
    are read in each other's place."""

    encode_with_feedback = None
    owner_step = None

    def _decode_into(self, packet, header, out, add):
        packet = packet.copy()
        n = out.size
        if self.name.endswith("onebit"):
            cols = -(-n // int(header["extra"]))
            means = packet[HEADER_SIZE:HEADER_SIZE + 8 * cols].view(np.float32).reshape(-1, 2)
            means[:] = means[:, ::-1].copy()
        elif n:
            from hpccomm.codecs.adaptive import COLUMN, COLUMN_BYTES, PREFIX

            H = int(packet[HEADER_SIZE:HEADER_SIZE + 4].view(np.uint32)[0])
            cols = packet[PREFIX:PREFIX + COLUMN_BYTES * -(-n // H)].view(COLUMN)
            cols["mu_pos"], cols["mu_neg"] = cols["mu_neg"].copy(), cols["mu_pos"].copy()
        super()._decode_into(packet, header, out, add)


def mutant_codec(mixin, name: str, **params):
    """An instance of codec ``name`` (with ``params``) broken by ``mixin``."""
    base = CODECS.get(name)
    body = {"name": f"{MUTANT}-{mixin.__name__.lower()}-{name}"}
    if mixin is ZeroDecoder and hasattr(base, "sparsify"):    # the sparse algorithms' pairs
        body["sparsify"] = ZeroDecoder._zero_pairs
    return type(f"{mixin.__name__}{base.__name__}", (mixin, base), body)(**params)


# ---------------------------------------------------------------------------
# error feedback
# ---------------------------------------------------------------------------
class DroppedResidual(ResidualMemory):
    """The residual memory, keeping nothing: every call starts from ``e = 0``."""

    def update(self, state, slot, v, decoded):
        pass

    def update_sparse(self, state, slot, v, idx, vals):
        pass

    def commit_fused(self, state, slot):
        state.spares.pop(slot, None)        # the new residual is thrown away


class DroppedOwnerResidual(ResidualMemory):
    """The worker's residual kept, the owner's (twoshot's re-encode) dropped."""

    @property
    def owner(self):
        return DroppedResidual()


# ---------------------------------------------------------------------------
# algorithms
# ---------------------------------------------------------------------------
def _zero_packet(codec, like, shape):
    """A packet of zeros of as many elements as ``like`` holds."""
    m = int(like[8:16].view("<u8")[0])
    return codec.encode(np.zeros(m, dtype=np.float32), EncodeContext(shape=shape))


class _LastRankLost:
    """A transport on which the last rank's data never arrives: its packets
    in all-to-alls and allgathers read as packets of zeros, its buffer in
    sum-allreduces as zeros."""

    def __init__(self, net, codec, shape):
        self._net, self._codec, self._shape = net, codec, shape
        self._last = net.comm.Get_rank() == net.comm.Get_size() - 1

    def __getattr__(self, name):
        return getattr(self._net, name)

    def _lose(self, packets):
        packets = list(packets)
        packets[-1] = _zero_packet(self._codec, packets[-1], self._shape)
        return packets

    def alltoallv(self, packets, recv_sizes=None, in_place=False):
        return self._lose(self._net.alltoallv(packets, recv_sizes, in_place=in_place))

    def allgatherv(self, packet, sizes=None):
        return self._lose(self._net.allgatherv(packet, sizes))

    def allreduce(self, buf, out=None, op="sum", nbytes=None):
        if op == "sum" and self._last:
            if out is None:
                buf[...] = 0
            else:
                buf = np.zeros_like(buf)
        return self._net.allreduce(buf, out, op, nbytes)


class _Reversed:
    """A transport whose all-to-all hands the packets over in reverse rank order."""

    def __init__(self, net):
        self._net = net

    def __getattr__(self, name):
        return getattr(self._net, name)

    def alltoallv(self, packets, recv_sizes=None, in_place=False):
        return list(self._net.alltoallv(packets, recv_sizes, in_place=in_place))[::-1]


def skipping(base_name: str):
    """Algorithm ``base_name`` that loses the last rank's contribution."""
    base = ALGORITHMS.get(base_name)
    from hpccomm.collectives.hierarchical import Hierarchical
    from hpccomm.collectives.sparse.base import SparseAlgorithm, sparsify

    body = {"name": f"{MUTANT}-skip-{base_name}",
            "sends_dense": lambda self, n, shape, key: False}   # no lean path around it
    if issubclass(base, SparseAlgorithm):
        def exchange(self, work, out, state, ctx):
            idx, vals = sparsify(self.codec, work.v, ctx.encode_context(self.rank))
            if self.rank == self.size - 1:
                idx, vals = idx[:0], vals[:0]
            self.reduce_sparse(idx, vals, work.x.size, state, ctx.net, out)
            work.sent_pairs(idx, vals)
        body["exchange"] = exchange
    elif issubclass(base, Hierarchical):
        def _setup(self, comm):
            return _LostSegment(base._setup(self, comm))
        body["_setup"] = _setup
    else:
        def reduce(self, x, out, state, ctx):
            net = _LastRankLost(ctx.net, self.codec, ctx.shape)
            base.reduce(self, x, out, state, replace(ctx, net=net))
        body["reduce"] = reduce
    return type(f"Skip{base.__name__}", (base,), body)


class _LostSegment:
    """hierarchical's node layout, with the last local rank's shared segment
    replaced on every rank by memory of its own: what that rank copies in
    never reaches the node's other owners, and its results never come back."""

    def __init__(self, layout):
        self._layout = layout

    def __getattr__(self, name):
        return getattr(self._layout, name)

    def segments(self, comm, n):
        segs = self._layout.segments(comm, n)
        if segs is None:
            return None
        return segs[:-1] + [np.zeros_like(segs[-1])]


def reversed_owner(base_name: str = "twoshot"):
    """twoshot whose owners sum the chunks in reverse rank order."""
    base = ALGORITHMS.get(base_name)

    def reduce(self, x, out, state, ctx):
        base.reduce(self, x, out, state, replace(ctx, net=_Reversed(ctx.net)))

    def fixed_transfers(self, exchange, call, bounds, slotted):
        # small packets of varying size travel in slots, around the transport
        alltoallv, allgatherv = base._fixed_transfers(self, exchange, call, bounds, slotted)
        return (lambda packets: list(alltoallv(packets))[::-1]), allgatherv
    return type(f"Reversed{base.__name__}", (base,),
                {"name": f"{MUTANT}-reversed-{base_name}", "reduce": reduce,
                 "_fixed_transfers": fixed_transfers,
                 "repeat_plan": lambda self, *args: None})      # no plan around it


@contextlib.contextmanager
def registered(cls):
    """``cls`` selectable by name while inside (every rank alike)."""
    ALGORITHMS.register(cls)
    try:
        yield cls.name
    finally:
        ALGORITHMS._classes.pop(cls.name, None)
