"""Helpers shared by the ``numba.cuda`` kernel modules
(:mod:`hpccomm.kernels.cuda_quantize`, :mod:`hpccomm.kernels.cuda_sparsify`,
:mod:`hpccomm.kernels.cuda_select`) and the device codecs
(:mod:`hpccomm.device_codecs`): device functions, launchers, transfers and
small elementwise kernels.

Every launch, copy and allocation here goes to the *current stream*
(:func:`current_stream`, set with :func:`on_stream`, or with :func:`on_device`
by the device pipeline to the stream that produced the user's buffer); the
default is numba's default stream, always named explicitly: a numba array
otherwise falls back to the stream it was allocated on, which may be gone.
Elementwise float32 arithmetic is one IEEE operation per element, as numpy's.
Launch only through :func:`launch`, :func:`launch_grid` and :func:`single`:
they refuse a kernel that was bound to an instance (a numba.cuda dispatcher
stored as a plain class attribute, read from an instance).  The kernels of
the ``cuda_*`` modules are compiled once per GPU architecture and cached on
disk (``cache=True``: ``__pycache__`` beside the source, or
``NUMBA_CACHE_DIR``).

Device functions for the kernels:

``fmul_rn`` / ``dmul_rn``
    float32 / float64 products rounded on their own (libdevice's ``mul.rn``).
    NVVM contracts a plain ``a * b`` that feeds an addition into a fused
    multiply-add, which rounds once and changes bits against the CPU; every
    float product of the kernels goes through these (the simulator:
    a plain multiply, which is IEEE).
``imin`` / ``imax``
    the builtin two-argument ``min`` / ``max`` (Python's: ``imin(a, b)`` is
    ``b if b < a else a``), which do not compile for the CUDA target in
    numba >= 0.66 (their ``*args`` overloads: numba/numba#10753).

``tests/test_cuda_compile.py`` compiles every kernel to sm_90 PTX and
rejects fused or unrounded float products and flush-to-zero.
"""
import contextlib
import importlib
import threading
import types

import numpy as np
from numba import config, cuda


def _check_numpy_for_numba_cuda():
    """Refuse, at import, a numpy that numba-cuda cannot compile kernels with.

    numba-cuda up to 0.30.4 (in maintenance: NVIDIA/numba-cuda#907) registers
    an overload of ``np.row_stack``, which numpy 2.5 removed, when it loads its
    array registries: on the first kernel compile or cache load, deep inside
    numba, as an ``AttributeError``.  A GPU image that pairs the two fails every
    kernel this way; the ``gpu-cuda12`` / ``gpu-cuda13`` extras pin
    ``numpy<2.5``.  The probe costs nothing where ``np.row_stack`` exists, and
    the simulator compiles nothing."""
    if config.ENABLE_CUDASIM or hasattr(np, "row_stack"):
        return
    try:
        importlib.import_module("numba.cuda.np.arrayobj")    # where the overload is
    except AttributeError as exc:
        raise ImportError(
            f"hpccomm's GPU kernels cannot compile: this numba-cuda fails with numpy "
            f"{np.__version__} ({exc}; NVIDIA/numba-cuda#907). Install numpy<2.5 "
            f"(the hpccomm[gpu-cuda12] and [gpu-cuda13] extras pin it), or a numba-cuda "
            f"that supports numpy {np.__version__}") from exc


_check_numpy_for_numba_cuda()

#: threads per block of the kernels here (the simulator runs each CUDA thread's code in Python)
THREADS = 32 if config.ENABLE_CUDASIM else 256
#: per thread, the stack of streams :func:`on_stream` set
_local = threading.local()
#: numba stream objects by (device, handle), made once (:func:`stream_for`)
_STREAMS: dict = {}


def current_stream():
    """The stream kernels and copies run on: the innermost :func:`on_stream`
    of this thread, else numba's default stream (a stream object, never 0)."""
    stack = getattr(_local, "streams", None)
    return stack[-1] if stack else cuda.default_stream()


@contextlib.contextmanager
def on_stream(stream):
    """Run the kernels and copies of the ``with`` block on ``stream`` (None:
    unchanged), on this thread."""
    if stream is None:
        yield
        return
    stack = _local.__dict__.setdefault("streams", [])
    stack.append(stream)
    try:
        yield
    finally:
        stack.pop()


def stream_for(device: int, handle: int):
    """The numba stream for the CUDA stream ``handle`` of GPU ``device`` (whose
    context is current): 0 and 1 the legacy default stream, 2 the per-thread
    default stream, any other an external stream (made once per device and
    handle)."""
    key = (int(device), int(handle))
    stream = _STREAMS.get(key)
    if stream is None:
        if handle in (0, 1):
            stream = cuda.legacy_default_stream()
        elif handle == 2:
            stream = cuda.per_thread_default_stream()
        else:
            stream = cuda.external_stream(int(handle))
        _STREAMS[key] = stream
    return stream


@contextlib.contextmanager
def on_device(device: int, handle: int):
    """Run the ``with`` block on GPU ``device`` (its primary context made
    current on this thread, whichever thread it is) and its kernels and
    copies on the stream ``handle`` of that device; yields the stream."""
    with cuda.gpus[device]:
        stream = stream_for(device, handle)
        with on_stream(stream):
            yield stream


def to_device(a, dtype=None):
    """A device array: numpy input is copied (as contiguous ``dtype``), device
    arrays pass through."""
    if isinstance(a, np.ndarray):
        return cuda.to_device(np.ascontiguousarray(a, dtype=dtype), stream=current_stream())
    return a


def empty(n, dtype):
    """A new flat device array of ``n`` elements (contents undefined)."""
    return cuda.device_array(int(n), dtype=dtype, stream=current_stream())


def to_host(a, out=None, wait: bool = True):
    """A host copy of device array ``a`` (into ``out`` when given), complete
    on return; ``wait=False``: only queued on the current stream (into
    pinned ``out``: complete after :func:`synchronize`)."""
    stream = current_stream()
    host = a.copy_to_host(out, stream=stream) if out is not None else a.copy_to_host(stream=stream)
    if wait:
        stream.synchronize()
    return host


def from_host(host, a):
    """Copy host array ``host`` into device array ``a`` (on the current stream)."""
    a.copy_to_device(host, stream=current_stream())


def kernel_of(kernel):
    """``kernel``, refused when it is a bound method: a numba.cuda dispatcher
    stored as a class attribute binds to the instance it is read from (as a
    function would), and a bound method cannot be configured for a launch."""
    if isinstance(kernel, types.MethodType):
        owner = type(kernel.__self__).__name__
        name = getattr(kernel.__func__, "__name__", repr(kernel.__func__))
        raise TypeError(f"kernel {name!r} was read from an instance of {owner} and bound to "
                        f"it as a method: store numba.cuda kernels in a class with "
                        f"staticmethod(...) (or call them from their module)")
    return kernel


def launch(threads, kernel, count, *args):
    """Run ``kernel`` on ``count`` items, one thread each, in blocks of
    ``threads`` on the current stream; nothing when ``count`` is 0."""
    kernel = kernel_of(kernel)
    if count > 0:
        kernel[(count + threads - 1) // threads, threads, current_stream()](*args)


#: most blocks of a grid-stride launch (the simulator runs each CUDA thread's code in Python)
GRID_BLOCKS = 2 if config.ENABLE_CUDASIM else 4096


def launch_grid(threads, kernel, count, *args):
    """Run the grid-stride ``kernel`` over ``count`` items: at most
    :data:`GRID_BLOCKS` blocks of ``threads`` on the current stream; nothing
    when ``count`` is 0."""
    kernel = kernel_of(kernel)
    if count > 0:
        blocks = min(-(-count // threads), GRID_BLOCKS)
        kernel[blocks, threads, current_stream()](*args)


def single(kernel, *args):
    """Run ``kernel`` on one device thread (current stream)."""
    kernel_of(kernel)[1, 1, current_stream()](*args)


# ---------------------------------------------------------------------------
# device functions
# ---------------------------------------------------------------------------
if config.ENABLE_CUDASIM:
    @cuda.jit(device=True)
    def dmul_rn(a, b):
        """``a * b`` in float64, rounded on its own (never fused)."""
        return a * b

    @cuda.jit(device=True)
    def fmul_rn(a, b):
        """``a * b`` in float32, rounded on its own (never fused)."""
        return a * b
else:  # pragma: no cover - compiled by tests/test_cuda_compile.py, run on a GPU
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def dmul_rn(a, b):
        """``a * b`` in float64, rounded on its own (never fused)."""
        return libdevice.dmul_rn(a, b)

    @cuda.jit(device=True)
    def fmul_rn(a, b):
        """``a * b`` in float32, rounded on its own (never fused)."""
        return libdevice.fmul_rn(a, b)


@cuda.jit(device=True)
def imin(a, b):
    """The builtin ``min(a, b)``: ``b if b < a else a``."""
    return b if b < a else a


@cuda.jit(device=True)
def imax(a, b):
    """The builtin ``max(a, b)``: ``b if b > a else a``."""
    return b if b > a else a


# ---------------------------------------------------------------------------
# elementwise kernels
# ---------------------------------------------------------------------------
@cuda.jit(cache=True)
def _binary(a, b, out, op):
    i = cuda.grid(1)
    if i < out.size:
        if op == 0:
            out[i] = a[i] + b[i]
        elif op == 1:
            out[i] = a[i] - b[i]
        else:
            out[i] = a[i]


@cuda.jit(cache=True)
def _fill(out, value):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = value


@cuda.jit(cache=True)
def _header(packet, version, codec, extra, n):
    if cuda.grid(1) == 0:
        packet[0] = 72          # b"HC"
        packet[1] = 67
        packet[2] = version
        packet[3] = codec
        for k in range(4):
            packet[4 + k] = (extra >> (8 * k)) & 0xFF
        for k in range(8):
            packet[8 + k] = (n >> (8 * k)) & 0xFF


@cuda.jit(cache=True)
def _count_nonfinite(x, count):
    i = cuda.grid(1)
    if i < x.size:
        v = x[i]
        if v != v or v - v != 0:        # NaN, or +-inf (inf - inf is NaN)
            cuda.atomic.add(count, 0, 1)


def add(a, b, out):
    """``out = a + b`` (float32); returns ``out``."""
    launch(THREADS, _binary, out.size, a, b, out, 0)
    return out


def subtract(a, b, out):
    """``out = a - b`` (float32); returns ``out``."""
    launch(THREADS, _binary, out.size, a, b, out, 1)
    return out


def copy(a, out):
    """``out[:] = a`` (device to device, same dtype); returns ``out``."""
    launch(THREADS, _binary, out.size, a, a, out, 2)
    return out


def fill(out, value):
    """``out[:] = value``; returns ``out``."""
    launch(THREADS, _fill, out.size, out, out.dtype.type(value))
    return out


def write_header(packet, version, codec_id, extra, n):
    """The common 16-byte packet header at ``packet[0:16]``, written by one
    device thread from its arguments (no host-to-device copy)."""
    single(_header, packet, np.uint8(version), np.uint8(codec_id), np.uint64(extra),
           np.uint64(n))


def count_nonfinite(x) -> int:
    """How many of the float32 ``x`` are NaN or +-inf (an integer count:
    independent of the order the threads add it in)."""
    if x.size == 0:
        return 0
    count = cuda.to_device(np.zeros(1, np.int64), stream=current_stream())
    launch(THREADS, _count_nonfinite, x.size, x, count)
    return int(to_host(count)[0])


@cuda.jit(cache=True)
def _divide(out, divisor):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = out[i] / divisor


def divide(out, divisor):
    """``out /= divisor`` in float32 (IEEE division, as numpy's); returns ``out``."""
    launch(THREADS, _divide, out.size, out, out.dtype.type(divisor))
    return out


# ---------------------------------------------------------------------------
# user buffers, streams and MPI
# ---------------------------------------------------------------------------
def as_kernel_array(obj):
    """A flat device array viewing the memory of ``obj`` (any C-contiguous
    ``__cuda_array_interface__`` object: CuPy, torch, numba), without a
    copy and without synchronizing its stream (the kernels run on it:
    :func:`on_device`).  Under the simulator the memory is host memory and
    the view is the simulator's array over it."""
    if config.ENABLE_CUDASIM:
        import ctypes

        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        cai = obj.__cuda_array_interface__
        dtype = np.dtype(cai["typestr"])
        n = int(np.prod(cai["shape"], dtype=np.int64))
        if n == 0:
            return FakeCUDAArray(np.empty(0, dtype))
        raw = (ctypes.c_char * (n * dtype.itemsize)).from_address(cai["data"][0])
        return FakeCUDAArray(np.frombuffer(raw, dtype, n))
    arr = cuda.as_cuda_array(obj, sync=False)
    return arr.reshape(arr.size)


def pointer_device(ptr: int) -> int:
    """The ordinal of the GPU whose memory holds device pointer ``ptr`` (0
    under the simulator, whose one "device" is host memory)."""
    if config.ENABLE_CUDASIM or not ptr:
        return 0
    from cuda.bindings import driver

    err, ordinal = driver.cuPointerGetAttribute(
        driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, int(ptr))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise ValueError(f"device pointer {int(ptr):#x}: cuPointerGetAttribute gave {err!r} "
                         "(not memory of a CUDA device?)")
    return int(ordinal)


def event():
    """A new CUDA event without timing (record it on one stream, wait for it
    on another)."""
    return cuda.event() if config.ENABLE_CUDASIM else cuda.event(timing=False)


def synchronize():
    """Wait for the current stream (before MPI reads what its kernels wrote)."""
    current_stream().synchronize()


def mpi_buffer(a):
    """What to hand MPI for device array ``a``: the array itself (CUDA-aware
    MPI reads its ``__cuda_array_interface__``); under the simulator, the host
    memory standing in for device memory."""
    if config.ENABLE_CUDASIM:
        return a._ary if hasattr(a, "_ary") else a
    return a
