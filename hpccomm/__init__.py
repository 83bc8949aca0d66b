"""hpccomm: compressed and sparse allreduce collectives for MPI.

>>> import numpy as np, hpccomm
>>> g = np.ones(1000, dtype=np.float32)
>>> total = hpccomm.allreduce(g)                       # plain MPI_Allreduce
>>> reducer = hpccomm.Allreducer(codec="none", algorithm="mpi", op="mean")
>>> avg = reducer(g, key="layer1.weight")              # keeps per-key state

Run under ``mpiexec -n P python -m mpi4py script.py`` so that an uncaught
exception on one rank aborts all of them.
"""
from ._version import __version__
from .buffers import DeviceBackend, register_device_backend, unregister_device_backend
from .codecs import Codec, EncodeContext, available_codecs, get_codec, register_codec
from .collectives import Algorithm, available_algorithms, register_algorithm
from .core import Allreducer, allreduce
from .errors import ConsistencyError, HpccommError, NonFiniteError, PacketError, RemoteError
from .kernels.threads import set_threads
from .sparse_vectors import SparseVector, sparse_algorithms, sparse_allreduce
from .stats import CallStats, Stats


def _load_plugins() -> None:
    """Import the modules named in ``HPCCOMM_PLUGINS`` (comma-separated), so
    that codecs and algorithms they register are usable by name everywhere,
    the benchmark commands included."""
    import importlib
    import os

    for name in os.environ.get("HPCCOMM_PLUGINS", "").split(","):
        if name.strip():
            importlib.import_module(name.strip())


_load_plugins()

__all__ = [
    "__version__",
    "allreduce",
    "Allreducer",
    "sparse_allreduce",
    "SparseVector",
    "sparse_algorithms",
    "available_codecs",
    "available_algorithms",
    "get_codec",
    "register_codec",
    "register_algorithm",
    "Codec",
    "EncodeContext",
    "Algorithm",
    "DeviceBackend",
    "register_device_backend",
    "unregister_device_backend",
    "Stats",
    "CallStats",
    "HpccommError",
    "ConsistencyError",
    "PacketError",
    "NonFiniteError",
    "RemoteError",
    "set_threads",
]
