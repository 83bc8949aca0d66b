"""Layouts: the shapes of the tensors fused into one flat buffer.

A fusion bucket (:mod:`hpccomm.buckets`, DDP's ``GradBucket``) is one flat
array holding several tensors end to end; its *layout* is their shapes, in
order.  Algorithms that work per tensor (``powersgd``: one matrix per layer)
read it from :attr:`hpccomm.collectives.base.ReduceContext.layout`, which
:meth:`hpccomm.Allreducer.__call__` fills from its ``layout`` argument after
:func:`check_layout`.
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple

import numpy as np


def numel(shape: Sequence[int]) -> int:
    """Elements of a tensor of ``shape`` (1 for ``()``)."""
    return int(math.prod(shape)) if len(shape) else 1


def check_layout(layout, n: int) -> Tuple[Tuple[int, ...], ...]:
    """``layout`` as a tuple of shapes whose sizes add up to ``n``, or
    ValueError / TypeError saying what is wrong."""
    if isinstance(layout, (str, bytes)) or not hasattr(layout, "__iter__"):
        raise TypeError(f"layout must be a sequence of shapes, not {type(layout).__name__}")
    shapes = []
    for shape in layout:
        if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
            shape = (shape,)
        try:
            dims = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise TypeError(f"layout entries are shapes (sequences of ints), not {shape!r}") \
                from None
        if any(d < 0 or isinstance(d0, bool) for d, d0 in zip(dims, shape)):
            raise ValueError(f"layout shape {tuple(shape)!r} has a negative or bool dimension")
        shapes.append(dims)
    total = sum(numel(s) for s in shapes)
    if total != n:
        raise ValueError(f"layout {shapes} holds {total} elements, the tensor has {n}")
    return tuple(shapes)
