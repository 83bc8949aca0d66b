"""Non-blocking reductions: :meth:`Allreducer.start` and its :class:`Request`.

    req_a = reducer.start(grad_a, key="a")        # returns at once
    req_b = reducer.start(grad_b, key="b", out=grad_b)
    ...                                           # compute while they reduce
    a = req_a.wait()                              # the blocking call's result, bit for bit
    req_b.wait()

How the work progresses: one *progress thread* per process (started on the
first ``start`` of any reducer) runs the started calls one after the other, in
start order, through the same code as the blocking call -- so a request's result is
bit-identical to the blocking call's, and the ranks meet in the same
collectives in the same order.  MPI calls (mpi4py releases the GIL while in
MPI) and the waits on the wire run while the caller's Python computes; the
numba kernels hold the GIL, so the encode of a bucket does not overlap with
Python-level compute of the caller (it does overlap with C/C++ compute that
releases the GIL, e.g. PyTorch's backward).  MPICH measured no independent
progress of non-blocking collectives here (``docs/results/overlap.md``), which is why
the thread, not ``MPI_I*`` calls, carries the overlap.

The thread waits in MPI's blocking calls, which poll at full speed.
``HPCCOMM_PROGRESS_SLEEP_US=N`` makes it wait with non-blocking calls tested
every N µs, sleeping in between, to leave the core to the caller's compute;
measured on the emulated 1 Gbit/s network (``docs/results/overlap.md``) that was no
faster for dense buckets and 1.1-1.7x slower for pipelined ``twoshot`` (MPICH
moves TCP data only while polled), so it is off by default.

Requirements and fallbacks: the thread calls MPI while the caller may call MPI
too, which needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default request).  Under a
lower thread level (a site MPI, or ``MPI4PY_RC_THREAD_LEVEL``) ``start`` runs
the call at once on the caller's thread and returns a completed request: the
same results, no overlap.  The reducer's collectives use its private
communicator, never the user's, so the user's own MPI calls cannot be
mismatched with them.

Order: every rank must start the same keys in the same order.  Unless
``check="never"``, each started call first agrees on its key and length with
one 32-byte allreduce (under ``check="always"`` the call's own agreement does
this); a mismatch raises the same :class:`~hpccomm.errors.ConsistencyError` on
every rank from ``wait()``.  Any error a blocking call raises on every rank is
raised on every rank by the request's ``wait()``; the next requests still run.

A blocking call of any reducer while requests are in flight queues behind
them (it is ``start(...).wait()``), and ``state_dict``, ``load_state_dict``,
``reset`` and ``close`` first wait for all requests: so the kernels never run
on two threads at once (numba's default threading layer forbids it), and every
rank meets the collectives of all its reducers in its program's order, as
blocking calls would.
"""
from __future__ import annotations

import atexit
import os
import queue
import threading
from typing import Any, Callable, List, Optional

from .collectives.transport import set_wait_interval

#: how the progress thread waits for a transfer: 0 (default), in MPI's blocking
#: calls; else tests it every this many seconds, sleeping in between
#: (``HPCCOMM_PROGRESS_SLEEP_US``)
WAIT_INTERVAL = float(os.environ.get("HPCCOMM_PROGRESS_SLEEP_US", "0")) * 1e-6


class Request:
    """A started reduction.  ``wait()`` returns what the blocking call returns
    (or raises what it raises); ``test()`` / ``done`` say whether it has
    finished, without blocking."""

    __slots__ = ("key", "_event", "_result", "_error", "_callbacks", "_lock")

    def __init__(self, key: Optional[str]):
        self.key = key
        self._event = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._callbacks: List[Callable[["Request"], None]] = []
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def test(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """The result; raises the call's error.  ``timeout`` (seconds) raises
        ``TimeoutError`` if the request has not finished by then."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"request for key {self.key!r} not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, fn: Callable[["Request"], None]) -> None:
        """Call ``fn(request)`` when it finishes (at once if it has) -- on the
        progress thread: keep it short, and never call the reducer from it."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, result: Any, error: Optional[BaseException]) -> None:
        self._result, self._error = result, error
        with self._lock:
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)


class ProgressThread:
    """One daemon thread that runs submitted jobs in submission order."""

    def __init__(self, name: str):
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        return self._pending

    def submit(self, request: Request, job: Callable[[], Any]) -> None:
        with self._idle:
            self._pending += 1
        self._jobs.put((request, job))

    def drain(self) -> None:
        """Wait until every submitted job has finished."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def _loop(self) -> None:
        set_wait_interval(WAIT_INTERVAL or None)
        while True:
            request, job = self._jobs.get()
            try:
                result, error = job(), None
            except BaseException as exc:  # noqa: BLE001 -- handed to wait()
                result, error = None, exc
            request._finish(result, error)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()


_thread: Optional[ProgressThread] = None
_thread_lock = threading.Lock()


def progress_thread() -> ProgressThread:
    """The process's progress thread (made on first use)."""
    global _thread
    with _thread_lock:
        if _thread is None:
            _thread = ProgressThread("hpccomm-progress")
            # calls still running at exit would meet MPI_Finalize (registered
            # earlier by mpi4py, so run later): finish them first
            atexit.register(_thread.drain)
            _drain_at_finalize(_thread)
        return _thread


def _drain_at_finalize(thread: ProgressThread) -> None:
    """Have ``MPI_Finalize`` wait for the started calls, also when the
    program calls it itself (``MPI.Finalize()``): its first act is to delete
    ``MPI_COMM_SELF``'s attributes, and this one's delete callback drains
    the thread, while MPI still works.  (Finalizing under a collective of
    the progress thread freed MPI's memory twice: glibc's ``double free``.)"""
    from mpi4py import MPI

    keyval = MPI.Comm.Create_keyval(delete_fn=lambda comm, key, value: thread.drain())
    MPI.COMM_SELF.Set_attr(keyval, True)


def pending() -> int:
    """Started calls not yet finished, over all reducers of this process."""
    return _thread.pending if _thread is not None else 0


def drain() -> None:
    """Wait until every started call of this process has finished."""
    if _thread is not None:
        _thread.drain()
