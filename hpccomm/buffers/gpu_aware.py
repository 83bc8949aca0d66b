"""Whether device pointers may be handed to MPI (CUDA-aware MPI detection)."""
from __future__ import annotations

import ctypes
import os


def _libmpi_handles():
    handles = [ctypes.CDLL(None)]
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and "/" in line}
        for path in sorted(paths):
            try:
                handles.append(ctypes.CDLL(path))
            except OSError:
                pass
    except OSError:
        pass
    return handles


def mpi_cuda_support() -> bool:
    """Whether the MPI library reports CUDA support at run time.

    Open MPI: ``MPIX_Query_cuda_support()``; MPICH:
    ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``.  The environment
    variable ``HPCCOMM_GPU_AWARE=0|1`` overrides the answer.
    """
    env = os.environ.get("HPCCOMM_GPU_AWARE")
    if env is not None:
        return env.strip().lower() in ("1", "yes", "on", "true")
    from mpi4py import MPI  # noqa: F401  (loads libmpi)

    for handle in _libmpi_handles():
        fn = getattr(handle, "MPIX_Query_cuda_support", None)
        if fn is not None:
            fn.restype = ctypes.c_int
            return bool(fn())
        fn = getattr(handle, "MPIX_GPU_query_support", None)
        if fn is not None:
            flag = ctypes.c_int(0)
            if fn(ctypes.c_int(1), ctypes.byref(flag)) == 0:  # 1 == MPIX_GPU_SUPPORT_CUDA
                return bool(flag.value)
    return False


def resolve_gpu_aware(gpu_aware) -> bool:
    if gpu_aware in (True, "on"):
        return True
    if gpu_aware in (False, "off"):
        return False
    if gpu_aware == "auto":
        return mpi_cuda_support()
    raise ValueError(f"gpu_aware must be 'auto', 'on' or 'off', not {gpu_aware!r}")
