"""Helpers shared by the ``numba.cuda`` kernel modules
(:mod:`hpccomm.kernels.cuda_quantize`, :mod:`hpccomm.kernels.cuda_sparsify`,
:mod:`hpccomm.kernels.cuda_select`) and the device codecs
(:mod:`hpccomm.device_codecs`): device functions, launchers, transfers and
small elementwise kernels.

Every launch and allocation here goes to the *current stream*
(:func:`current_stream`, set with :func:`on_stream` by the device pipeline
to the stream that produced the user's buffer); the default is stream 0.
Elementwise float32 arithmetic is one IEEE operation per element, as numpy's.

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

import numpy as np
from numba import config, cuda

#: threads per block of the kernels here (the simulator runs one Python thread per CUDA thread)
THREADS = 32 if config.ENABLE_CUDASIM else 256
_STREAM = [0]


def current_stream():
    """The stream kernels and copies run on (0: the default stream)."""
    return _STREAM[-1]


@contextlib.contextmanager
def on_stream(stream):
    """Run the kernels of the ``with`` block on ``stream`` (None: unchanged)."""
    if stream is None:
        yield
        return
    _STREAM.append(stream)
    try:
        yield
    finally:
        _STREAM.pop()


def to_device(a, dtype=None):
    """A device array: numpy input is copied (as contiguous ``dtype``), device
    arrays pass through."""
    if isinstance(a, np.ndarray):
        return cuda.to_device(np.ascontiguousarray(a, dtype=dtype), stream=current_stream())
    return a


def empty(n, dtype):
    """A new flat device array of ``n`` elements (contents undefined)."""
    return cuda.device_array(int(n), dtype=dtype, stream=current_stream())


def to_host(a, out=None):
    """A host copy of device array ``a`` (into ``out`` when given), complete on return."""
    stream = current_stream()
    host = a.copy_to_host(out, stream=stream) if out is not None else a.copy_to_host(stream=stream)
    if stream:
        stream.synchronize()
    return host


def from_host(host, a):
    """Copy host array ``host`` into device array ``a`` (on the current stream)."""
    a.copy_to_device(host, stream=current_stream())


def launch(threads, kernel, count, *args):
    """Run ``kernel`` on ``count`` items, one thread each, in blocks of
    ``threads`` on the current stream; nothing when ``count`` is 0."""
    if count > 0:
        kernel[(count + threads - 1) // threads, threads, current_stream()](*args)


#: most blocks of a grid-stride launch (the simulator runs a Python thread per CUDA thread)
GRID_BLOCKS = 2 if config.ENABLE_CUDASIM else 4096


def launch_grid(threads, kernel, count, *args):
    """Run the grid-stride ``kernel`` over ``count`` items: at most
    :data:`GRID_BLOCKS` blocks of ``threads`` on the current stream; nothing
    when ``count`` is 0."""
    if count > 0:
        blocks = min(-(-count // threads), GRID_BLOCKS)
        kernel[blocks, threads, current_stream()](*args)


def single(kernel, *args):
    """Run ``kernel`` on one device thread (current stream)."""
    kernel[1, 1, current_stream()](*args)


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
@cuda.jit
def _binary(a, b, out, op):
    i = cuda.grid(1)
    if i < out.size:
        if op == 0:
            out[i] = a[i] + b[i]
        elif op == 1:
            out[i] = a[i] - b[i]
        else:
            out[i] = a[i]


@cuda.jit
def _fill(out, value):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = value


@cuda.jit
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


@cuda.jit
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


@cuda.jit
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
    copy and without synchronizing its stream (the kernels run on it,
    :func:`stream_of`).  Under the simulator the memory is host memory and
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


def stream_of(obj):
    """The stream that produced ``obj``: the one its
    ``__cuda_array_interface__`` (v3) names, else CuPy's current stream when
    CuPy is loaded, else the default stream (0)."""
    if config.ENABLE_CUDASIM:
        return 0
    ptr = getattr(obj, "__cuda_array_interface__", {}).get("stream")
    if ptr is None:
        import sys

        cupy = sys.modules.get("cupy")
        ptr = cupy.cuda.get_current_stream().ptr if cupy is not None else 0
    return cuda.external_stream(ptr) if ptr else 0


def synchronize():
    """Wait for the current stream (before MPI reads what its kernels wrote)."""
    stream = current_stream()
    if stream:
        stream.synchronize()
    else:
        cuda.synchronize()


def mpi_buffer(a):
    """What to hand MPI for device array ``a``: the array itself (CUDA-aware
    MPI reads its ``__cuda_array_interface__``); under the simulator, the host
    memory standing in for device memory."""
    if config.ENABLE_CUDASIM:
        return a._ary if hasattr(a, "_ary") else a
    return a
