"""Sparse allreduce algorithms: sums of (index, value) pairs.  See :mod:`.base`."""
import importlib
import pkgutil

from .base import SparseAlgorithm, index_dtype

# every module registers its algorithm: adding one is adding a file
for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_mod}")

__all__ = ["SparseAlgorithm", "index_dtype"]
