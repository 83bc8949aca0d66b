"""Algorithms: how packets move between ranks.  See :mod:`.base`."""
from .base import (Algorithm, ReduceContext, available_algorithms,  # noqa: F401
                   get_algorithm_class, register_algorithm)
from . import allgather, mpi, summable, twoshot  # noqa: F401  (register)
from . import (kylix, oktopk, rle_pipeline, sparse_allgather, sparse_op,  # noqa: F401
               sparse_rd, sparse_split)  # (register)

__all__ = ["Algorithm", "ReduceContext", "available_algorithms", "get_algorithm_class",
           "register_algorithm"]
