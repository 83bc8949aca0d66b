"""Device backends: what hpccomm needs to do with device arrays (CuPy,
numba.cuda, or a backend the user registers).

Before MPI or a host copy reads device memory, the producing stream is
synchronized: the stream named in ``__cuda_array_interface__`` (version 3),
else the current CuPy stream.
"""
from __future__ import annotations

from typing import Any, List

import numpy as np


class DeviceBackend:
    """Operations hpccomm needs on device arrays.  Subclass and
    :func:`register_device_backend` to support another array type."""

    name = "device"
    #: hpccomm's numba.cuda kernels may run on this backend's arrays: their
    #: memory is what numba.cuda addresses (device memory; host memory under
    #: numba's simulator).  Without it device input is staged whole through
    #: the host.
    device_kernels = False

    def matches(self, obj: Any) -> bool:
        raise NotImplementedError

    def synchronize(self, obj: Any) -> None:
        """Wait until the stream that produced ``obj`` is done."""
        raise NotImplementedError

    def to_host(self, obj: Any, out: np.ndarray) -> None:
        """Copy the flat contents of ``obj`` into host array ``out``."""
        raise NotImplementedError

    def from_host(self, host: np.ndarray, obj: Any) -> None:
        """Copy host array ``host`` into the flat contents of ``obj``."""
        raise NotImplementedError

    def empty_like(self, obj: Any) -> Any:
        """A new device array of the same shape and dtype."""
        raise NotImplementedError

    def copy(self, src: Any, dst: Any) -> None:
        """Device-to-device copy of the flat contents of ``src`` into ``dst``."""
        raise NotImplementedError

    def divide(self, obj: Any, divisor: int) -> None:
        """``obj /= divisor`` elementwise, in place (IEEE division, as on the host)."""
        raise NotImplementedError

    def count_nonfinite(self, obj: Any, size: int, dtype: str) -> int:
        """Number of NaN / Inf among the ``size`` elements of ``obj`` (of
        hpccomm's ``dtype`` name; ``"bfloat16"`` included), after
        :meth:`synchronize`.  Default: float32 / float64 on a backend with
        :attr:`device_kernels` by a reduction on the device (one integer comes
        back); otherwise through a host copy."""
        if self.device_kernels and dtype in ("float32", "float64"):
            from ..kernels import cuda_util

            with cuda_util.on_stream(cuda_util.stream_of(obj)):
                return cuda_util.count_nonfinite(cuda_util.as_kernel_array(obj))
        from ..kernels.nonfinite import count_nonfinite

        bf16 = dtype == "bfloat16"
        host = np.empty(size, dtype=np.uint16 if bf16 else np.dtype(dtype))
        self.to_host(obj, host)
        return count_nonfinite(host, bfloat16=bf16)

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        """Host staging memory (page-locked where the backend can)."""
        return np.empty(nbytes, dtype=np.uint8)


def _cai_stream_sync(cai: dict) -> bool:
    """Synchronize the stream named in a v3 ``__cuda_array_interface__``."""
    stream = cai.get("stream")
    if stream in (None, 0):
        return False
    try:
        import cupy

        cupy.cuda.ExternalStream(stream).synchronize()
        return True
    except Exception:  # pragma: no cover - needs a GPU
        from numba import cuda

        cuda.external_stream(stream).synchronize()
        return True


class CupyBackend(DeviceBackend):
    """Device arrays through CuPy (accepts any ``__cuda_array_interface__``)."""

    name = "cupy"
    device_kernels = True

    def __init__(self):
        import cupy  # noqa: F401  (ImportError means: not available)

        self._cupy = cupy

    def matches(self, obj):  # pragma: no cover - needs a GPU
        return isinstance(obj, self._cupy.ndarray) or hasattr(obj, "__cuda_array_interface__")

    def _as(self, obj):  # pragma: no cover - needs a GPU
        return self._cupy.asarray(obj).reshape(-1)

    def synchronize(self, obj):  # pragma: no cover - needs a GPU
        cai = getattr(obj, "__cuda_array_interface__", None)
        if not (cai and _cai_stream_sync(cai)):
            self._cupy.cuda.get_current_stream().synchronize()

    def to_host(self, obj, out):  # pragma: no cover - needs a GPU
        self._as(obj).get(out=out)

    def from_host(self, host, obj):  # pragma: no cover - needs a GPU
        self._as(obj).set(host)

    def empty_like(self, obj):  # pragma: no cover - needs a GPU
        return self._cupy.empty_like(self._cupy.asarray(obj))

    def copy(self, src, dst):  # pragma: no cover - needs a GPU
        self._as(dst)[...] = self._as(src)

    def divide(self, obj, divisor):  # pragma: no cover - needs a GPU
        arr = self._as(obj)
        arr /= arr.dtype.type(divisor)

    def count_nonfinite(self, obj, size, dtype):  # pragma: no cover - needs a GPU
        arr = self._as(obj)
        if dtype == "bfloat16":     # all exponent bits set, on the bit patterns
            bits = arr.view(self._cupy.uint16)
            return int(self._cupy.count_nonzero((bits & 0x7F80) == 0x7F80))
        return int(self._cupy.count_nonzero(~self._cupy.isfinite(arr)))

    def pinned_empty(self, nbytes):  # pragma: no cover - needs a GPU
        mem = self._cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
        return np.frombuffer(mem, dtype=np.uint8, count=nbytes)


class NumbaCudaBackend(DeviceBackend):  # pragma: no cover - needs a GPU
    """Device arrays through numba.cuda, for machines without CuPy."""

    name = "numba.cuda"
    device_kernels = True

    def __init__(self):
        from numba import cuda

        if not cuda.is_available() or not hasattr(cuda, "as_cuda_array"):
            raise ImportError("numba.cuda has no usable device")
        self._cuda = cuda

    def matches(self, obj):
        return hasattr(obj, "__cuda_array_interface__")

    def _as(self, obj):
        return self._cuda.as_cuda_array(obj).reshape(-1)

    def synchronize(self, obj):
        if not _cai_stream_sync(obj.__cuda_array_interface__):
            self._cuda.synchronize()

    def to_host(self, obj, out):
        self._as(obj).copy_to_host(out)

    def from_host(self, host, obj):
        self._as(obj).copy_to_device(host)

    def empty_like(self, obj):
        arr = self._cuda.as_cuda_array(obj)
        return self._cuda.device_array(arr.shape, dtype=arr.dtype)

    def copy(self, src, dst):
        self._as(dst).copy_to_device(self._as(src))

    def divide(self, obj, divisor):
        from ..kernels import cuda_util

        arr = self._as(obj)
        with cuda_util.on_stream(cuda_util.stream_of(obj)):
            cuda_util.divide(arr, divisor)

    def pinned_empty(self, nbytes):
        return self._cuda.pinned_array(max(nbytes, 1), dtype=np.uint8)[:nbytes]


_BACKENDS: List[DeviceBackend] = []
_DEFAULTS_LOADED = False


def register_device_backend(backend: DeviceBackend, first: bool = True) -> None:
    """Add a device backend; ``first=True`` gives it priority."""
    if first:
        _BACKENDS.insert(0, backend)
    else:
        _BACKENDS.append(backend)


def unregister_device_backend(backend: DeviceBackend) -> None:
    if backend in _BACKENDS:
        _BACKENDS.remove(backend)


def _load_default_backends() -> None:
    global _DEFAULTS_LOADED
    if _DEFAULTS_LOADED:
        return
    _DEFAULTS_LOADED = True
    for cls in (CupyBackend, NumbaCudaBackend):
        try:
            _BACKENDS.append(cls())
        except Exception:
            pass


def device_backend_for(obj: Any) -> DeviceBackend:
    _load_default_backends()
    for backend in _BACKENDS:
        if backend.matches(obj):
            return backend
    raise TypeError(
        f"{type(obj).__name__} lives in device memory but no device backend handles it: "
        "install CuPy (pip install 'hpccomm[gpu]') or register a DeviceBackend"
    )


