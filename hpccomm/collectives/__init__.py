"""Algorithms: how packets move between ranks.  See :mod:`.base`; the sparse
ones live in :mod:`.sparse`, every MPI call in :mod:`.transport`."""
import importlib
import pkgutil

from .base import (Algorithm, Contribution, ReduceContext, available_algorithms,  # noqa: F401
                   get_algorithm_class, register_algorithm)

# every module (and the sparse package) registers its algorithm: adding one is adding a file
for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_mod}")

__all__ = ["Algorithm", "Contribution", "ReduceContext", "available_algorithms",
           "get_algorithm_class", "register_algorithm"]
