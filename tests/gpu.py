"""What the ``gpu`` tests (``tests/test_gpu.py``, ``tests/test_gpu_mpi.py``)
run on: a real GPU when numba.cuda finds one, or numba's CUDA simulator when
``NUMBA_ENABLE_CUDASIM=1`` (``./dev.sh gpu --simulate``: the same tests at
tiny sizes, on host memory presented as device memory).  Elsewhere they skip.

    MODE      "gpu", "sim" or "" (skip, for the reason in MISSING)
    KINDS     the device buffer kinds to test: "cupy", "torch" (CUDA) on a
              GPU where they work; "sim" on the simulator
"""
import ctypes
import os
import sys

import numpy as np

#: where numba.cuda looks for the driver on Linux (``locate_driver_and_loader``
#: of numba-cuda; tests/test_runner.py checks the list against it)
LINUX_DRIVERS = tuple(os.path.join(d, name) for d in ("", "/usr/lib", "/usr/lib64")
                      for name in ("libcuda.so", "libcuda.so.1"))


def _no_driver() -> bool:
    """True where no CUDA driver can load (Linux, none of the libraries
    numba.cuda would try opens): the tests skip without importing numba.cuda,
    which takes 1.2-1.7 s of each process that collects them (every rank of
    every MPI run of the suite)."""
    # a driver named to numba (numba's own numba.cuda honours NUMBA_CUDA_DRIVER;
    # numba-cuda ignores it), or ./dev.sh gpu: numba.cuda itself decides
    if (not sys.platform.startswith("linux") or os.environ.get("NUMBA_CUDA_DRIVER")
            or os.environ.get("HPCCOMM_GPU_CHECK")):
        return False
    for name in LINUX_DRIVERS:
        try:
            ctypes.CDLL(name)
            return False
        except OSError:
            continue
    return True


def _skip_before_numba():
    """Why the tests skip, known before numba.cuda is imported (None: ask it).
    The simulator needs no driver."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") in ("", "0") and _no_driver():
        return "no CUDA driver (libcuda) on this machine"
    return None


def _mode():
    reason = _skip_before_numba()
    if reason:
        return "", reason
    try:
        from numba import config, cuda
    except ImportError as exc:
        return "", f"numba.cuda unavailable: {exc}"
    if config.ENABLE_CUDASIM:
        return "sim", ""
    try:
        return ("gpu", "") if cuda.is_available() else ("", "numba.cuda finds no GPU")
    except Exception as exc:  # noqa: BLE001 - any driver error means: no GPU here
        return "", f"numba.cuda: {exc}"


MODE, MISSING = _mode()
SIM = MODE == "sim"


def _kinds():
    if MODE == "sim":
        return ["sim"]
    kinds = []
    if MODE == "gpu":
        try:
            import cupy

            cupy.zeros(1)
            kinds.append("cupy")
        except Exception:  # noqa: BLE001 - no working CuPy: test the others
            pass
        try:
            import torch

            if torch.cuda.is_available():
                kinds.append("torch")
        except ImportError:
            pass
    return kinds


KINDS = _kinds()


def device_array(x: np.ndarray, kind: str):
    """A device copy of ``x`` as ``kind`` ("cupy", "torch" or "sim")."""
    x = np.ascontiguousarray(x)
    if kind == "cupy":
        import cupy

        return cupy.asarray(x)
    if kind == "torch":
        import torch

        return torch.from_numpy(x).cuda()
    from hpccomm.buffers.host_device import HostDeviceArray

    return HostDeviceArray(x.copy())


def host(obj) -> np.ndarray:
    """A host copy of a device array of :func:`device_array`'s kinds (the
    stream that wrote it synchronized by the copy)."""
    kind = type(obj).__module__.split(".")[0]
    if kind == "cupy":
        return obj.get()
    if kind == "torch":
        return obj.cpu().numpy()
    return obj.host.copy()


def register_sim_backend():
    """Under the simulator: the backend of ``"sim"`` arrays, with kernels
    (returns it, for :func:`unregister`; None on a GPU)."""
    if not SIM:
        return None
    import hpccomm
    from hpccomm.buffers.host_device import HostDeviceBackend

    backend = HostDeviceBackend(device_kernels=True)
    hpccomm.register_device_backend(backend)
    return backend


def unregister(backend) -> None:
    if backend is not None:
        import hpccomm

        hpccomm.unregister_device_backend(backend)
