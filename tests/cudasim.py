"""numba's CUDA simulator, made to behave like a GPU where hpccomm's device
code could tell the difference, and a way to run checks on it.

``NUMBA_ENABLE_CUDASIM`` must be set before numba is imported, so the
simulator tests run in processes that have it set: each check function of
``tests/test_cuda_*.py`` in a fresh interpreter (:func:`run_check`), the
MPI tests marked ``cudasim`` under ``tests/run.py`` (``conftest.py``
installs the harness there), and ``./dev.sh gpu --simulate``, which runs
the benchmarks through ``python tests/cudasim.py -m MODULE ARGS``.

:func:`install` closes the gaps between the simulator and a GPU that hid
real failures:

* **Kernels bind like dispatchers.**  A real ``CUDADispatcher`` has
  ``__get__``: stored as a class attribute and read from an instance it
  becomes a bound method, which cannot be configured for a launch.  The
  simulator's ``FakeCUDAKernel`` had none, so every simulator test passed
  while every dense twin failed on an H100.  It gets the dispatcher's
  ``__get__`` here.
* **Host-side arrays have only a device array's attributes.**  The
  simulator's ``FakeCUDAArray`` hands any attribute it lacks to the numpy
  array behind it (``.copy()``, ``.sum()`` ...), which numba's
  ``DeviceNDArray`` does not have.  Outside a kernel, an attribute that
  :data:`DEVICE_ARRAY_API` (numba's ``DeviceNDArray``, checked against the
  real class by ``tests/test_cuda_harness.py``) does not list raises.
* **Streams exist and are recorded.**  The simulator ignores the stream of
  a launch and has no external streams.  Here ``cuda.external_stream(h)``
  gives a :class:`SimStream` with handle ``h``, and every launch, copy and
  allocation notes the stream it was given while :func:`record_streams` is
  active, and so does every event recorded on a stream or waited for by one
  (``"event record"``, ``"event wait"``), so a test can demand that a call ran
  all of its work on the stream of its input, after what it had to wait for.

* **A block's shared arrays are one array.**  The simulator makes a shared
  array on the first call of ``cuda.shared.array`` from a source line with a
  check-then-set that two threads of the block can both pass, each then
  working on an array of its own; here the allocation is atomic.  (The
  simulator's threads used to switch only every 5 ms, which hid it.)

It also makes the simulator fast enough to use: numba-cuda's simulator takes
a lock around every call of a device function, and with Python's default
5 ms thread switch interval the threads of a block that wait for it queue
behind the block manager's polling loop (a kernel of eight threads ran 60
times slower than with the lock-free simulator of numba's own numba.cuda);
threads switch every 10 µs here.  And a block's ``syncthreads()`` is a
barrier on a condition (:class:`_Barrier`) that the block's runner waits for
by joining its threads, where numba-cuda's runner polls every thread in a
loop that takes its turn at the interpreter with them.
"""
import contextlib
import functools
import os
import runpy
import subprocess
import sys
import threading
import types

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}

#: what numba's ``DeviceNDArray`` offers on the host: its public class
#: attributes and the attributes its ``__init__`` sets
DEVICE_ARRAY_API = frozenset([
    "T", "as_cuda_arg", "bind", "copy_to_device", "copy_to_host", "device_ctypes_pointer",
    "flags", "get_ipc_handle", "getitem", "is_c_contiguous", "is_f_contiguous", "nbytes",
    "ravel", "reshape", "setitem", "split", "squeeze", "transpose", "view",
    "alloc_size", "dtype", "gpu_data", "ndim", "shape", "size", "stream", "strides",
])

#: the streams recorded by :func:`record_streams` (None: not recording)
_RECORD = [None]


class SimStream:
    """An external stream in the simulator: it only has a handle (work runs
    at once, in order, as on the simulator's other streams)."""

    def __init__(self, handle):
        self.handle = int(handle)

    def synchronize(self):
        pass

    @contextlib.contextmanager
    def auto_synchronize(self):
        yield

    def __repr__(self):
        return f"<SimStream {self.handle:#x}>"


@contextlib.contextmanager
def record_streams():
    """Collect ``(what, stream)`` of every launch, copy and allocation in the
    ``with`` block; yields the list."""
    log = []
    _RECORD[0] = log
    try:
        yield log
    finally:
        _RECORD[0] = None


def _note(what, stream):
    if _RECORD[0] is not None:
        _RECORD[0].append((what, stream))


def install() -> None:
    """Patch the simulator as the module docstring says (once per process)."""
    from numba import config, cuda

    assert config.ENABLE_CUDASIM, "the harness patches numba's simulator: NUMBA_ENABLE_CUDASIM=1"
    from numba.cuda.simulator import kernel as K
    from numba.cuda.simulator import kernelapi
    from numba.cuda.simulator.cudadrv import devicearray as D

    kernel_cls, array_cls = K.FakeCUDAKernel, D.FakeCUDAArray
    if getattr(kernel_cls, "_hpccomm_harness", False):
        return
    kernel_cls._hpccomm_harness = True
    sys.setswitchinterval(1e-5)

    def __get__(self, obj, objtype=None):       # numba's _DispatcherBase.__get__
        return self if obj is None else types.MethodType(self, obj)

    kernel_cls.__get__ = __get__

    configure = kernel_cls.__getitem__

    def __getitem__(self, launch):
        _note(f"launch {getattr(self.fn, '__name__', '?')}", launch[2] if len(launch) > 2 else 0)
        return configure(self, launch)

    kernel_cls.__getitem__ = __getitem__

    delegate = array_cls.__getattr__

    def __getattr__(self, name):
        if K._kernel_context is None and not name.startswith("__") \
                and name not in DEVICE_ARRAY_API:
            raise AttributeError(f"numba's DeviceNDArray has no attribute {name!r} (the "
                                 f"simulator's array would take it from numpy)")
        return delegate(self, name)

    array_cls.__getattr__ = __getattr__

    def recorded(what, fn, position):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            stream = kwargs.get("stream", args[position] if len(args) > position else 0)
            _note(what, stream)
            return fn(*args, **kwargs)
        return wrapper

    array_cls.copy_to_host = recorded("copy_to_host", array_cls.copy_to_host, 2)
    array_cls.copy_to_device = recorded("copy_to_device", array_cls.copy_to_device, 2)
    cuda.to_device = recorded("to_device", cuda.to_device, 1)
    allocate = cuda.device_array

    @functools.wraps(allocate)
    def device_array(*args, **kwargs):
        _note("device_array", kwargs.get("stream", 0))
        return allocate(*args, **kwargs)

    cuda.device_array = device_array
    cuda.external_stream = SimStream

    class Event(cuda.event):
        def record(self, stream=0):
            _note("event record", stream)
            return super().record(stream)

        def wait(self, stream=0):
            _note("event wait", stream)
            return super().wait(stream)

    cuda.event = Event

    allocate_shared = kernelapi.FakeCUDAShared.array

    def shared_array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:     # dynamic shared memory, or refused
            return allocate_shared(self, shape, dtype, alignment)
        if isinstance(dtype, kernelapi.types.Type):  # numba's int64 ..., as the simulator does
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)                      # the kernel's line, as the simulator keys it
        caller = (frame.f_code.co_filename, frame.f_lineno)
        return self._allocations.setdefault(caller, np.empty(shape, dtype))

    kernelapi.FakeCUDAShared.array = shared_array
    K.BlockManager.run = _block_runner(K)


class _Barrier:
    """``syncthreads()`` of one simulated block, as numba-cuda's block runner
    has it: it releases when every thread still running waits at it (a
    thread that has returned is not waited for), and a thread that raised
    aborts the others (their ``syncthreads()`` raises, as there)."""

    def __init__(self, threads):
        self.threads = threads
        self.cond = threading.Condition()
        self.live = len(threads)
        self.waiting = 0
        self.generation = 0
        self.failed = None                  # the first thread that raised

    def _release(self):
        self.waiting = 0
        self.generation += 1
        self.cond.notify_all()

    def wait(self):
        with self.cond:
            generation = self.generation
            self.waiting += 1
            if self.waiting == self.live:
                self._release()
                return
            while self.generation == generation and self.failed is None:
                self.cond.wait()

    def leave(self, thread):
        with self.cond:
            self.live -= 1
            if thread.exception is not None:
                if self.failed is None:
                    self.failed = thread
                    for t in self.threads:
                        t.abort = True
                    self.cond.notify_all()
            elif self.waiting and self.waiting == self.live:
                self._release()


#: what makes the threads of a block wait for each other
_BARRIERS = frozenset(["syncthreads", "syncthreads_count", "syncthreads_and", "syncthreads_or",
                       "syncwarp", "this_grid", "sync"])


def _waits_for_its_block(K, fn, seen) -> bool:
    """Whether kernel or device function ``fn`` may call a barrier: its
    code, its nested code, and the device functions it reaches by a global
    name or an attribute of a module it names (conservative: any name match)."""
    codes, names = [fn.__code__], set()
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    if names & _BARRIERS:
        return True
    for name in names:
        value = fn.__globals__.get(name)
        found = [value] if not isinstance(value, types.ModuleType) else \
            [getattr(value, other, None) for other in names]
        for obj in found:
            inner = getattr(obj, "fn", None) if isinstance(obj, K.FakeCUDAKernel) else None
            if inner is not None and inner not in seen:
                seen.add(inner)
                if _waits_for_its_block(K, inner, seen):
                    return True
    return False


def _named(exc, thread):
    """``exc`` with the thread that raised it in its message, as the
    simulator names it (``tid=[..] ctaid=[..]: message``); a RuntimeError
    where the exception's type takes other arguments than a message (the
    simulator's own runner then loses the exception, and the launch passes)."""
    where = f"tid={list(thread.threadIdx)} ctaid={list(thread.blockIdx)}"
    try:
        return type(exc)(f"{where}: {exc}" if str(exc) else where)
    except Exception:
        return RuntimeError(f"{where}: {type(exc).__name__}: {exc}")


def _block_runner(K):
    """numba-cuda's ``BlockManager.run`` (``K``: ``numba.cuda.simulator.kernel``)
    with :class:`_Barrier` for its polling loop, and a block of a kernel
    that calls no barrier (:func:`_waits_for_its_block`) run thread after
    thread on one Python thread: a schedule a GPU may run too, without a
    Python thread started per CUDA thread (its start is most of the cost)."""
    barrier_free = {}

    class BlockThread(K.BlockThread):
        def run(self):
            try:
                self._target()
            except Exception as e:
                self.exception = (_named(e, self), sys.exc_info()[2])
            finally:
                self._manager.barrier.leave(self)

        def syncthreads(self):
            if self.abort:
                raise RuntimeError("abort flag set on syncthreads call")
            self._manager.barrier.wait()
            if self.abort:
                raise RuntimeError("abort flag set on syncthreads clear")

    class SerialBlock(K.BlockThread):
        """Every CUDA thread of one block, in order, as this Python thread."""

        def run(self):
            bx, by, _ = self._manager._block_dim
            for point in np.ndindex(*self._manager._block_dim):
                self.threadIdx = K.Dim3(*point)
                self.thread_id = point[0] + bx * (point[1] + by * point[2])
                try:
                    self._target()
                except Exception as e:
                    self.exception = (_named(e, self), sys.exc_info()[2])
                    return

        def syncthreads(self):
            raise RuntimeError("the harness ran this block thread after thread, finding no "
                               "barrier in its kernel, yet it called one: extend _BARRIERS")

    def run(self, grid_point, *args):
        serial = barrier_free.get(self._f)
        if serial is None:
            serial = barrier_free[self._f] = not _waits_for_its_block(K, self._f, {self._f})
        target = lambda: self._f(*args)  # noqa: E731
        if serial:
            threads = [SerialBlock(target, self, grid_point, (0, 0, 0), self._debug)]
        else:
            threads = [BlockThread(target, self, grid_point, point, self._debug)
                       for point in np.ndindex(*self._block_dim)]
            self.barrier = _Barrier(threads)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = (None if serial else self.barrier.failed) \
            or next((t for t in threads if t.exception), None)
        if failed is not None:
            raise failed.exception[0].with_traceback(failed.exception[1])

    return run


def simulator_missing() -> str:
    """Why the simulator cannot run here, or '' when it can."""
    return _simulator_missing(sys.executable)


@functools.lru_cache(maxsize=None)
def _simulator_missing(python) -> str:
    probe = subprocess.run([python, "-c", "from numba import cuda; cuda.to_device"],
                           env=ENV, capture_output=True, text=True, timeout=120)
    return "" if probe.returncode == 0 else probe.stderr.strip()[-200:]


def run_check(module: str, check: str, timeout: int = 300) -> None:
    """Run ``tests.<module>.<check>()`` on the simulator, with the harness
    installed; fail with its output."""
    import pytest

    if simulator_missing():
        pytest.skip(f"numba.cuda simulator unavailable: {simulator_missing()}")
    proc = subprocess.run([sys.executable, "-c", "from tests.cudasim import install; install(); "
                           f"from tests.{module} import {check}; {check}()"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def main(argv) -> None:
    """``python tests/cudasim.py -m MODULE ARGS...``: run a module as
    ``python -m`` would, on the simulator with the harness installed."""
    if len(argv) < 2 or argv[0] != "-m":
        raise SystemExit("usage: NUMBA_ENABLE_CUDASIM=1 python tests/cudasim.py -m MODULE ARGS...")
    install()
    sys.argv = [argv[1]] + list(argv[2:])
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main(sys.argv[1:])
