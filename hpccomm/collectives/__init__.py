"""Algorithms: how packets move between ranks.  See :mod:`.base`."""
from .base import (Algorithm, ReduceContext, available_algorithms,  # noqa: F401
                   get_algorithm_class, register_algorithm)
from . import mpi  # noqa: F401  (registers)

__all__ = ["Algorithm", "ReduceContext", "available_algorithms", "get_algorithm_class",
           "register_algorithm"]
