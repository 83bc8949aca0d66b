"""Sparse allreduce algorithms: sums of (index, value) pairs.  See :mod:`.base`."""
from . import (allgather, kylix, mpi_op, oktopk, recursive_doubling,  # noqa: F401  (register)
               rle_pipeline, split_allgather)
from .base import SparseAlgorithm, index_dtype

__all__ = ["SparseAlgorithm", "index_dtype"]
