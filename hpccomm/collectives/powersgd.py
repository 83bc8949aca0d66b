"""``powersgd``: PowerSGD's two allreduces of low-rank factors, for all
matrices of a call at once (Vogels et al. 2019, Algorithm 1; PyTorch's
``powerSGD_hook``).  It carries the codec ``powersgd`` only, which holds
the options and the plan (:mod:`hpccomm.codecs.powersgd`).

Each tensor of the call's layout is a matrix ``M`` (``n x m``, compressed at
rank ``r``) or dense (see the codec).  One call:

1. ``v = x + e`` (the template's memory: the residual of the whole flat
   buffer).  During the first ``start_iter`` calls of a key, or when no
   tensor is compressed: one ``MPI_Allreduce`` of ``v``, and done (the
   residual becomes zero).
2. ``Q`` per matrix: the previous call's reduced ``Q`` of the key
   (``warm_start``), else uniform values in ``[-1, 1)`` from the shared seed
   and the step (the same on every rank); orthogonalised (Gram-Schmidt), as
   PyTorch does.
3. ``P = M Q`` for every matrix into one buffer, the dense tensors' values
   after them.
4. ``MPI_Allreduce`` (sum) of that buffer: the ``P`` of every matrix and the
   dense tensors in one call.
5. Orthogonalise each reduced ``P`` (modified Gram-Schmidt in float64: the
   same bits on every rank, which all hold the same ``P``).
6. ``Q_w = M^T P`` for every matrix into a second buffer (this rank's).
7. ``MPI_Allreduce`` (sum) of the ``Q`` buffer.
8. ``out = P Q^T`` per matrix (the sum over ranks of ``P P^T M_w``); the
   dense tensors' sums from step 4.  With error feedback, this rank's share
   is ``P Q_w^T`` (its own projection, the paper's ``e = M - decompress``),
   so the memory keeps ``e = v - P Q_w^T``: the part of ``M_w`` outside the
   span of ``P``, and zero for dense tensors.  PyTorch's hook keeps
   ``v - P Q^T / world_size`` instead (the averaged approximation, and
   ``v - mean`` for its dense tensors).
9. Keep the reduced ``Q`` for the next call's warm start (``state_dict``
   saves it with the residual).

Wire volume: ``sum r (n + m)`` float32 over the matrices plus the dense
elements per rank, reduced by ``MPI_Allreduce`` (its traffic is modelled,
about ``2 (P - 1) / P`` of that).  Every product accumulates in float64 in
a fixed order (:mod:`hpccomm.kernels.lowrank`), and ``MPI_Allreduce`` gives
every rank the same sums, so every rank gets the same bits.

Passes over the gradient: the compensate (step 1), two products reading
``M`` (steps 3 and 6), one writing ``out`` and this rank's share together
(step 8), and the memory's update (``e = v - share``).
"""
from __future__ import annotations

from typing import List

import numpy as np

from ..codecs.powersgd import Layer
from ..kernels import lowrank as K
from ..kernels import threads
from ..kernels.rng import stream_key
from .base import Algorithm, register_algorithm

#: the key's slot (in ``KeyState.residuals``, saved by state_dict) of the
#: reduced Q factors of the previous call
Q_SLOT = "powersgd:q"


@register_algorithm
class PowerSGD(Algorithm):
    name = "powersgd"

    def check_codec(self, codec):
        if codec.algorithm != self.name:
            raise ValueError(f"algorithm 'powersgd' carries codec 'powersgd' only, not "
                             f"{codec.name!r}")

    def check_memory(self, memory):
        if memory.name not in ("none", "residual"):
            raise ValueError(f"algorithm 'powersgd' keeps a plain residual or none, not memory "
                             f"{memory.name!r}")

    def exchange(self, work, out, state, ctx):
        codec, net, call = self.codec, ctx.net, ctx.call
        v = work.v
        n = v.size
        layers = codec.plan(ctx.layout if ctx.layout is not None else (ctx.shape,))
        matrices = [layer for layer in layers if layer.compressed]
        if ctx.step < codec.start_iter or not matrices:
            call.extra["powersgd"] = "start_iter" if matrices else "no matrix"
            call.extra["wire_floats"] = n
            if self.size > 1:
                net.allreduce(v, out)
            else:
                out[...] = v
            work.decoded(0, n, v)
            return
        dense = [layer for layer in layers if not layer.compressed]
        p_off, q_off = _offsets(matrices, "rows"), _offsets(matrices, "cols")
        np_, nq = p_off[-1], q_off[-1]
        nd = sum(layer.size for layer in dense)
        threads.use()

        with call.time("encode"):
            # 2. Q: the warm start, or shared random values; orthogonalised
            qs = state.residuals.get(Q_SLOT) if codec.warm_start else None
            if qs is None or qs.size != nq:
                qs = np.empty(nq, dtype=np.float32)
                K.fill_uniform(stream_key(ctx.seed, 0, ctx.step, codec.codec_id), qs)
            for j, layer in enumerate(matrices):
                K.orthogonalize(_factor(qs, q_off[j], layer.cols, layer.rank),
                                codec.orthogonalization_epsilon)
            # 3. P = M Q, the dense tensors after the P's
            first = self.scratch("p", np_ + nd)
            for j, layer in enumerate(matrices):
                K.project(_matrix(v, layer), _factor(qs, q_off[j], layer.cols, layer.rank),
                          _factor(first, p_off[j], layer.rows, layer.rank))
            at = np_
            for layer in dense:
                first[at:at + layer.size] = v[layer.offset:layer.offset + layer.size]
                at += layer.size
        # 4. one allreduce: every P and the dense tensors
        if self.size > 1:
            net.allreduce(first)
        with call.time("encode"):
            # 5. orthogonalise P; 6. this rank's Q = M^T P
            own_q = self.scratch("own_q", nq)
            for j, layer in enumerate(matrices):
                p = _factor(first, p_off[j], layer.rows, layer.rank)
                K.orthogonalize(p, codec.orthogonalization_epsilon)
                K.back_project(_matrix(v, layer), p, _factor(own_q, q_off[j], layer.cols,
                                                             layer.rank))
        # 7. one allreduce: every Q
        second = np.empty(nq, dtype=np.float32)
        if self.size > 1:
            net.allreduce(own_q, second)
        else:
            second[...] = own_q
        with call.time("decode"):
            # 8. out = P Q^T; this rank's share P Q_w^T; the dense sums
            feedback = ctx.memory.enabled
            own = self.scratch("own", n) if feedback else None
            for j, layer in enumerate(matrices):
                p = _factor(first, p_off[j], layer.rows, layer.rank)
                q = _factor(second, q_off[j], layer.cols, layer.rank)
                if feedback:
                    K.expand_pair(p, q, _factor(own_q, q_off[j], layer.cols, layer.rank),
                                  _matrix(out, layer), _matrix(own, layer))
                else:
                    K.expand(p, q, _matrix(out, layer))
            at = np_
            for layer in dense:
                lo, hi = layer.offset, layer.offset + layer.size
                out[lo:hi] = first[at:at + layer.size]
                if feedback:
                    own[lo:hi] = v[lo:hi]
                at += layer.size
        # 9. the reduced Q for the next call
        if codec.warm_start:
            state.residuals[Q_SLOT] = second
        call.extra["wire_floats"] = np_ + nd + nq
        call.extra["powersgd"] = f"{len(matrices)} matrices, {len(dense)} dense"
        work.decoded(0, n, own if feedback else out)


def _offsets(matrices: List[Layer], side: str) -> List[int]:
    """Start of each matrix's factor (``rows`` for P, ``cols`` for Q) in a
    buffer of all of them, and the total at the end."""
    offsets = [0]
    for layer in matrices:
        offsets.append(offsets[-1] + getattr(layer, side) * layer.rank)
    return offsets


def _factor(buf: np.ndarray, offset: int, k: int, r: int) -> np.ndarray:
    return buf[offset:offset + k * r].reshape(k, r)


def _matrix(flat: np.ndarray, layer: Layer) -> np.ndarray:
    return flat[layer.offset:layer.offset + layer.size].reshape(layer.rows, layer.cols)
