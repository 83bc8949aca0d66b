"""Whether device pointers may be handed to MPI (CUDA-aware MPI detection)."""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Tuple


def _libmpi_handles():
    """``(handle, where)`` for the process's own symbols and each libmpi it
    has loaded (``where``: the library's path, or ``"the process"``)."""
    handles = [(ctypes.CDLL(None), "the process")]
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and "/" in line}
        for path in sorted(paths):
            try:
                handles.append((ctypes.CDLL(path), path))
            except OSError:
                pass
    except OSError:
        pass
    return handles


def mpi_cuda_support_reason() -> Tuple[bool, str]:
    """Whether device pointers may go to MPI, and why: ``(answer, reason)``.

    Open MPI: ``MPIX_Query_cuda_support()``; MPICH:
    ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``, asked of the
    libmpi the process has loaded.  The environment variable
    ``HPCCOMM_GPU_AWARE=0|1`` overrides the answer.
    """
    env = os.environ.get("HPCCOMM_GPU_AWARE")
    if env is not None:
        answer = env.strip().lower() in ("1", "yes", "on", "true")
        return answer, f"HPCCOMM_GPU_AWARE={env}, the library not asked"
    return _library_answer()


@functools.lru_cache(maxsize=None)
def _library_answer() -> Tuple[bool, str]:
    """What the loaded libmpi answers, asked once per process: the library
    cannot change once mpi4py has loaded it, and finding it reads
    ``/proc/self/maps`` (about 3 ms with torch's libraries mapped: most of
    an ``Allreducer``'s construction)."""
    from mpi4py import MPI  # noqa: F401  (loads libmpi)

    for handle, where in _libmpi_handles():
        fn = getattr(handle, "MPIX_Query_cuda_support", None)
        if fn is not None:
            fn.restype = ctypes.c_int
            value = fn()
            return bool(value), f"MPIX_Query_cuda_support() = {value} in {where}"
        fn = getattr(handle, "MPIX_GPU_query_support", None)
        if fn is not None:
            flag = ctypes.c_int(0)
            if fn(ctypes.c_int(1), ctypes.byref(flag)) == 0:  # 1 == MPIX_GPU_SUPPORT_CUDA
                return (bool(flag.value),
                        f"MPIX_GPU_query_support(CUDA) = {flag.value} in {where}")
    return False, ("the MPI library answers neither MPIX_Query_cuda_support nor "
                   "MPIX_GPU_query_support")


def mpi_cuda_support() -> bool:
    """Whether the MPI library reports CUDA support at run time
    (:func:`mpi_cuda_support_reason` without the reason)."""
    return mpi_cuda_support_reason()[0]


def resolve_gpu_aware(gpu_aware) -> bool:
    if gpu_aware in (True, "on"):
        return True
    if gpu_aware in (False, "off"):
        return False
    if gpu_aware == "auto":
        return mpi_cuda_support()
    raise ValueError(f"gpu_aware must be 'auto', 'on' or 'off', not {gpu_aware!r}")
