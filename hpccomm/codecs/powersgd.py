"""``powersgd``: PowerSGD's low-rank compression (Vogels, Karimireddy and
Jaggi, NeurIPS 2019), with PyTorch's ``powerSGD_hook`` options.

PowerSGD is not a packet codec: its unit is a list of matrices, and what goes
on the wire are the factors ``P`` and ``Q`` of every matrix of a bucket,
which add up across ranks and are reduced with plain ``MPI_Allreduce``.  This
class holds the options and the plan -- which tensors of a call are
compressed, at which rank, and how many floats go on the wire -- and
:mod:`hpccomm.collectives.powersgd` (the algorithm ``powersgd``, the only
one that carries this codec) runs the steps.  ``Allreducer(codec="powersgd")``
picks that algorithm by itself.

Options (PyTorch's ``PowerSGDState`` names in brackets):

* ``rank`` (``matrix_approximation_rank``, default 1): the rank ``r`` of the
  approximation; a matrix of ``n x m`` uses ``min(r, n, m)``;
* ``warm_start`` (default True): start each step's power iteration from the
  previous step's ``Q`` of the same layer (kept per key, saved by
  ``state_dict``), else from fresh random values;
* ``start_iter`` (``start_powerSGD_iter``, default 0): the first ``start_iter``
  calls of a key are reduced dense (one ``MPI_Allreduce``; with error
  feedback the residual stays zero).  PyTorch's default is 1000 because DDP
  rebuilds its buckets after the first iteration; hpccomm's keys are stable,
  so the warm-up is the user's choice;
* ``min_compression_rate`` (default 2): a matrix is compressed only when
  ``(n + m) r * min_compression_rate < n m`` (PyTorch's
  ``_should_compress``), else it is sent dense;
* ``orthogonalization_epsilon`` (default 0): added to each column's norm in
  the Gram-Schmidt step.

Which tensors are matrices: each tensor of the call's layout (the ``layout``
of :meth:`hpccomm.Allreducer.__call__`: the shapes of the tensors fused into
the flat buffer, as DDP's ``bucket.gradients()``; else the input's own
shape) with two or more dimensions is viewed as ``shape[0] x
prod(shape[1:])`` (as PyTorch's ``tensor.view(shape[0], -1)``); one- and
zero-dimensional tensors are sent dense, as PyTorch does.

Wire volume per call: ``sum over compressed tensors of r (n + m)`` float32
plus the elements of the dense tensors -- PyTorch's ``compression_stats()``
count ``numel_after_compression``.  The dense tensors travel in the first
allreduce, beside the ``P`` factors (PyTorch sends them in an allreduce of
their own): two allreduces per call, one before a dense-only call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from ..layout import numel as _numel
from .base import Codec, register_codec


@dataclass(frozen=True)
class Layer:
    """One tensor of a call: ``size`` elements at ``offset`` of the flat
    buffer; compressed as a ``rows x cols`` matrix at rank ``rank`` (``rank``
    0: sent dense)."""
    offset: int
    size: int
    rows: int
    cols: int
    rank: int

    @property
    def compressed(self) -> bool:
        return self.rank > 0

    @property
    def wire_floats(self) -> int:
        return self.rank * (self.rows + self.cols) if self.rank else self.size


@register_codec
class PowerSGDCodec(Codec):
    name = "powersgd"
    codec_id = 14
    #: the algorithm that carries the factors (this codec has no packets)
    algorithm = "powersgd"
    biased = True
    dense = True
    fixed_size = False

    def __init__(self, rank: int = 1, warm_start: bool = True, start_iter: int = 0,
                 min_compression_rate: float = 2.0, orthogonalization_epsilon: float = 0.0,
                 nonfinite: str = "raise"):
        super().__init__(nonfinite=nonfinite)
        if nonfinite != "raise":
            raise ValueError("powersgd: nonfinite must be 'raise' (a NaN in one rank's matrix "
                             "would reach every element of the reduced factors)")
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
            raise ValueError(f"powersgd: rank must be a positive integer, not {rank!r}")
        if not isinstance(warm_start, (bool, np.bool_)):
            raise ValueError(f"powersgd: warm_start must be a bool, not {warm_start!r}")
        if isinstance(start_iter, bool) or not isinstance(start_iter, (int, np.integer)) \
                or start_iter < 0:
            raise ValueError(f"powersgd: start_iter must be an integer >= 0, not {start_iter!r}")
        for name, value in (("min_compression_rate", min_compression_rate),
                            ("orthogonalization_epsilon", orthogonalization_epsilon)):
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"powersgd: {name} must be a finite number >= 0, not {value!r}")
        self.rank = int(rank)
        self.warm_start = bool(warm_start)
        self.start_iter = int(start_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)

    def params(self):
        return {"rank": self.rank, "warm_start": self.warm_start, "start_iter": self.start_iter,
                "min_compression_rate": self.min_compression_rate,
                "orthogonalization_epsilon": self.orthogonalization_epsilon}

    def should_compress(self, rows: int, cols: int) -> int:
        """The rank a ``rows x cols`` matrix is compressed at, 0 when it is
        sent dense (PyTorch's ``_should_compress`` on the clipped rank)."""
        r = min(self.rank, rows, cols)
        if r == 0 or (rows + cols) * r * self.min_compression_rate >= rows * cols:
            return 0
        return r

    def plan(self, layout: Sequence[Sequence[int]]) -> List[Layer]:
        """The :class:`Layer` of every tensor of ``layout`` (shapes, in order)."""
        layers, offset = [], 0
        for shape in layout:
            size = _numel(shape)
            rows, cols, r = size, 1, 0
            if len(shape) >= 2 and size:
                rows, cols = int(shape[0]), size // int(shape[0])
                r = self.should_compress(rows, cols)
            layers.append(Layer(offset, size, rows, cols, r))
            offset += size
        return layers

    def wire_floats(self, layout: Sequence[Sequence[int]]) -> int:
        """Floats this rank contributes per compressed call of ``layout``:
        ``r (n + m)`` per compressed matrix plus the dense elements."""
        return sum(layer.wire_floats for layer in self.plan(layout))

    # -- no packets ----------------------------------------------------------
    def _no_packets(self, *args, **kwargs):
        raise TypeError("powersgd has no packets: its factors are reduced by the algorithm "
                        "'powersgd' (Allreducer(codec='powersgd') picks it)")

    _encode = _decode_into = _no_packets

    def check_header(self, packet, n, size: Optional[int] = None):
        self._no_packets()

    def check_tolerance(self, nranks, error_feedback):
        return 2.0
