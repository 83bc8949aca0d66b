"""Device backends: what hpccomm needs to do with device arrays (torch CUDA
tensors, CuPy, numba.cuda, or a backend the user registers).

Where device data lives is a :class:`Placement`: the GPU that holds it and
the CUDA stream whose work produced it.  The reducer asks the backend once
per call, on the caller's thread (a started call's progress thread has
streams of its own: torch's and CuPy's current streams are per thread), and
hands the answer to every operation of the call: each runs on that GPU and
is ordered on that stream, so a result is ready for the caller's next work
on it, and nothing reads the input before the caller's stream has written
it.  Copies to and from host memory are complete on return (the host may
then read, or reuse, its buffer).
"""
from __future__ import annotations

import sys
from typing import Any, List, NamedTuple

import numpy as np


class Placement(NamedTuple):
    """Where device data lives."""

    #: the ordinal of the GPU whose memory holds it
    device: int
    #: the CUDA stream handle its producer ran on (0: the legacy default
    #: stream; 2: the per-thread default stream)
    stream: int


def cai_stream(obj: Any) -> int:
    """The stream a ``__cuda_array_interface__`` (version 3) names; 0 (the
    default stream) when it names none, i.e. asks for no synchronization."""
    stream = obj.__cuda_array_interface__.get("stream")
    return 0 if stream is None else int(stream)


def cai_placement(obj: Any) -> Placement:
    """The placement a ``__cuda_array_interface__`` describes: the device of
    its data pointer and the stream it names."""
    from ..kernels.cuda_util import pointer_device

    return Placement(pointer_device(obj.__cuda_array_interface__["data"][0]), cai_stream(obj))


class DeviceBackend:
    """Operations hpccomm needs on device arrays.  Subclass and
    :func:`register_device_backend` to support another array type.

    Every operation but :meth:`matches`, :meth:`placement` and
    :meth:`pinned_empty` gets the call's :class:`Placement` as ``where``
    (what :meth:`placement` said on the caller's thread) and runs on that
    device and stream."""

    name = "device"
    #: hpccomm's numba.cuda kernels may run on this backend's arrays: their
    #: memory is what numba.cuda addresses (device memory; host memory under
    #: numba's simulator).  Without it device input is staged whole through
    #: the host.
    device_kernels = False

    def matches(self, obj: Any) -> bool:
        raise NotImplementedError

    def placement(self, obj: Any) -> Placement:
        """Where ``obj`` lives and which stream produced it, as the calling
        thread sees it.  Default: :func:`cai_placement`."""
        return cai_placement(obj)

    def synchronize(self, obj: Any, where: Placement) -> None:
        """Wait until the stream that produced ``obj`` is done."""
        raise NotImplementedError

    def to_host(self, obj: Any, out: np.ndarray, where: Placement) -> None:
        """Copy the flat contents of ``obj`` into host array ``out``, complete on return."""
        raise NotImplementedError

    def from_host(self, host: np.ndarray, obj: Any, where: Placement) -> None:
        """Copy host array ``host`` into the flat contents of ``obj``, complete
        on return."""
        raise NotImplementedError

    def empty_like(self, obj: Any, where: Placement) -> Any:
        """A new device array of the same shape and dtype, on ``where.device``."""
        raise NotImplementedError

    def copy(self, src: Any, dst: Any, where: Placement) -> None:
        """Device-to-device copy of the flat contents of ``src`` into ``dst``."""
        raise NotImplementedError

    def divide(self, obj: Any, divisor: int, where: Placement) -> None:
        """``obj /= divisor`` elementwise, in place (IEEE division, as on the host)."""
        raise NotImplementedError

    def count_nonfinite(self, obj: Any, size: int, dtype: str, where: Placement) -> int:
        """Number of NaN / Inf among the ``size`` elements of ``obj`` (of
        hpccomm's ``dtype`` name; ``"bfloat16"`` included).  Default: float32 /
        float64 on a backend with :attr:`device_kernels` by a reduction on the
        device, on ``where``'s stream (one integer comes back); otherwise
        through a host copy."""
        if self.device_kernels and dtype in ("float32", "float64"):
            from ..kernels import cuda_util

            with cuda_util.on_device(*where):
                return cuda_util.count_nonfinite(cuda_util.as_kernel_array(obj))
        from ..kernels.nonfinite import count_nonfinite

        bf16 = dtype == "bfloat16"
        host = np.empty(size, dtype=np.uint16 if bf16 else np.dtype(dtype))
        self.to_host(obj, host, where)
        return count_nonfinite(host, bfloat16=bf16)

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        """Host staging memory (page-locked where the backend can)."""
        return np.empty(nbytes, dtype=np.uint8)


def _divide_on_device(arr, divisor, where: Placement) -> None:
    """``arr /= divisor`` by hpccomm's IEEE division kernel (float32 ``/``,
    one rounding: numpy's bits) on ``where``."""
    from ..kernels import cuda_util

    with cuda_util.on_device(*where):
        cuda_util.divide(cuda_util.as_kernel_array(arr), divisor)


class TorchBackend(DeviceBackend):  # pragma: no cover - needs a GPU
    """torch CUDA tensors, through torch itself.  A tensor's stream is torch's
    current stream on its device (torch's ``__cuda_array_interface__`` names
    none)."""

    name = "torch"
    device_kernels = True

    def matches(self, obj):
        torch = sys.modules.get("torch")
        return torch is not None and isinstance(obj, torch.Tensor) and obj.is_cuda

    def placement(self, obj):
        import torch

        return Placement(obj.device.index, torch.cuda.current_stream(obj.device).cuda_stream)

    @staticmethod
    def _stream(obj, where):
        """torch's stream object for ``where.stream`` on ``obj``'s device."""
        import torch

        current = torch.cuda.current_stream(obj.device)
        if current.cuda_stream == where.stream:
            return current
        if where.stream == 0:
            return torch.cuda.default_stream(obj.device)
        return torch.cuda.ExternalStream(where.stream, device=obj.device)

    @staticmethod
    def _bytes(obj):
        """The flat bytes of a contiguous tensor (copies move bits, whatever the dtype)."""
        return obj.reshape(-1).view(__import__("torch").uint8)

    def synchronize(self, obj, where):
        self._stream(obj, where).synchronize()

    def to_host(self, obj, out, where):
        import torch

        with torch.cuda.stream(self._stream(obj, where)):
            torch.from_numpy(out.view(np.uint8)).copy_(self._bytes(obj))   # blocking

    def from_host(self, host, obj, where):
        import torch

        with torch.cuda.stream(self._stream(obj, where)):
            self._bytes(obj).copy_(torch.from_numpy(host.view(np.uint8)))  # blocking

    def empty_like(self, obj, where):
        import torch

        with torch.cuda.stream(self._stream(obj, where)):
            return torch.empty_like(obj)

    def copy(self, src, dst, where):
        import torch

        with torch.cuda.stream(self._stream(dst, where)):
            dst.reshape(-1).copy_(src.reshape(-1))

    def divide(self, obj, divisor, where):
        # torch divides by a scalar as a product with its reciprocal: not IEEE division
        _divide_on_device(obj, divisor, where)

    def count_nonfinite(self, obj, size, dtype, where):
        import torch

        if dtype in ("float32", "float64"):
            return super().count_nonfinite(obj, size, dtype, where)
        with torch.cuda.stream(self._stream(obj, where)):
            return int((~torch.isfinite(obj)).sum().item())

    def pinned_empty(self, nbytes):
        import torch

        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True).numpy()[:nbytes]


class CupyBackend(DeviceBackend):
    """Device arrays through CuPy (accepts any ``__cuda_array_interface__``).
    A CuPy array's stream is CuPy's current stream on its device."""

    name = "cupy"
    device_kernels = True

    def __init__(self):
        import cupy  # noqa: F401  (ImportError means: not available)

        self._cupy = cupy

    def matches(self, obj):  # pragma: no cover - needs a GPU
        return isinstance(obj, self._cupy.ndarray) or hasattr(obj, "__cuda_array_interface__")

    def placement(self, obj):  # pragma: no cover - needs a GPU
        cupy = self._cupy
        if not isinstance(obj, cupy.ndarray):
            return cai_placement(obj)
        device = obj.device.id
        with cupy.cuda.Device(device):
            return Placement(device, cupy.cuda.get_current_stream().ptr)

    def _on(self, where):  # pragma: no cover - needs a GPU
        """CuPy's device and an ExternalStream for ``where`` (a context: the
        stream is made current on the device)."""
        cupy = self._cupy
        return cupy.cuda.Device(where.device), cupy.cuda.ExternalStream(where.stream, where.device)

    def _as(self, obj):  # pragma: no cover - needs a GPU
        return self._cupy.asarray(obj).reshape(-1)

    def _bytes(self, obj):  # pragma: no cover - needs a GPU
        """The flat bytes of ``obj`` (copies move bits, whatever the dtype)."""
        return self._as(obj).view(self._cupy.uint8)

    def synchronize(self, obj, where):  # pragma: no cover - needs a GPU
        device, stream = self._on(where)
        with device:
            stream.synchronize()

    def to_host(self, obj, out, where):  # pragma: no cover - needs a GPU
        device, stream = self._on(where)
        with device, stream:
            self._bytes(obj).get(stream=stream, out=out.view(np.uint8))
            stream.synchronize()

    def from_host(self, host, obj, where):  # pragma: no cover - needs a GPU
        device, stream = self._on(where)
        with device, stream:
            self._bytes(obj).set(host.view(np.uint8), stream=stream)
            stream.synchronize()

    def empty_like(self, obj, where):  # pragma: no cover - needs a GPU
        device, stream = self._on(where)
        with device, stream:
            return self._cupy.empty_like(self._cupy.asarray(obj))

    def copy(self, src, dst, where):  # pragma: no cover - needs a GPU
        device, stream = self._on(where)
        with device, stream:
            self._as(dst)[...] = self._as(src)

    def divide(self, obj, divisor, where):  # pragma: no cover - needs a GPU
        _divide_on_device(obj, divisor, where)

    def count_nonfinite(self, obj, size, dtype, where):  # pragma: no cover - needs a GPU
        if dtype in ("float32", "float64"):
            return super().count_nonfinite(obj, size, dtype, where)
        device, stream = self._on(where)
        with device, stream:
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
        from numba import config, cuda

        if config.ENABLE_CUDASIM or not cuda.is_available():
            raise ImportError("numba.cuda has no usable device")
        self._cuda = cuda

    def matches(self, obj):
        return hasattr(obj, "__cuda_array_interface__")

    @staticmethod
    def _flat(obj):
        from ..kernels import cuda_util

        return cuda_util.as_kernel_array(obj)

    def _bytes(self, obj):
        return self._flat(obj).view(np.uint8)

    def synchronize(self, obj, where):
        from ..kernels import cuda_util

        with cuda_util.on_device(*where):
            cuda_util.synchronize()

    def to_host(self, obj, out, where):
        from ..kernels import cuda_util

        with cuda_util.on_device(*where):
            cuda_util.to_host(self._bytes(obj), out.view(np.uint8))

    def from_host(self, host, obj, where):
        from ..kernels import cuda_util

        with cuda_util.on_device(*where):
            cuda_util.from_host(host.view(np.uint8), self._bytes(obj))
            cuda_util.synchronize()

    def empty_like(self, obj, where):
        from ..kernels import cuda_util

        cai = obj.__cuda_array_interface__
        with cuda_util.on_device(*where) as stream:
            return self._cuda.device_array(tuple(cai["shape"]), dtype=np.dtype(cai["typestr"]),
                                           stream=stream)

    def copy(self, src, dst, where):
        from ..kernels import cuda_util

        with cuda_util.on_device(*where) as stream:
            self._flat(dst).copy_to_device(self._flat(src), stream=stream)

    def divide(self, obj, divisor, where):
        _divide_on_device(obj, divisor, where)

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
    _BACKENDS.append(TorchBackend())     # imports nothing: matches only if torch is loaded
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
        "install CuPy (pip install 'hpccomm[gpu-cuda12]' or '[gpu-cuda13]') or register a DeviceBackend"
    )
