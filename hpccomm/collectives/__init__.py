"""Algorithms: how packets move between ranks.  See :mod:`.base`; the sparse
ones live in :mod:`.sparse`, every MPI call in :mod:`.transport`."""
from .base import (Algorithm, Contribution, ReduceContext, available_algorithms,  # noqa: F401
                   get_algorithm_class, register_algorithm)
from . import allgather, mpi, summable, twoshot  # noqa: F401  (register)
from . import sparse  # noqa: F401  (registers the sparse algorithms)

__all__ = ["Algorithm", "Contribution", "ReduceContext", "available_algorithms",
           "get_algorithm_class", "register_algorithm"]
