"""Errors inside a collective: fail-stop.

An error one rank finds *before* a call's first transfer is raised on every
rank by the call's agreement (:mod:`hpccomm.validation`).  An exception raised
on some ranks *inside* the call -- a packet that one rank's decoder refuses,
a plug-in codec or a device kernel that raises on one rank, an MPI error --
leaves the other ranks in the call's next transfer, where they would wait
forever.  hpccomm then stops the job (``on_error="abort"``, the default, as
NCCL's asynchronous error handling does): the failing rank prints its
traceback and one line naming its rank, the exception and the call, then
calls ``MPI_Abort``, which ends every process of the job (MPICH and Open MPI
both do).  ``on_error="raise"`` raises on the failing rank only: for a
debugger on one rank, or a caller that ends the job itself.

Exceptions the agreement raised (:func:`~hpccomm.validation.raised_everywhere`)
are raised on every rank alike and propagate; so do all exceptions on one
rank (nothing to strand).  ``KeyboardInterrupt`` and ``SystemExit`` are not
caught.

Why not raise the same exception on every rank instead: the other ranks sit
in a blocking MPI call that only the failing rank's part of the transfer can
end.  Reaching them there needs every transfer made non-blocking and waited
beside a wildcard receive that would carry the alarm, and a closing check on
every call (one more small allreduce) for errors after the last transfer --
the final decode, where every algorithm can fail.  Both were measured
(``docs/results/reliability.md``): the closing check adds 1-4 % to a small
compressed call on shared memory and about 30 % on the emulated 1 Gbit/s
link; the alarmed waits cost nothing with a core per rank, and made every
transfer take 4-16 ms (up to 590x) with more ranks than cores.  That is a
price on every call for an event that means a fault in the hardware or the
software, after which the step is lost anyway.
"""
from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Callable

from mpi4py import MPI

from .validation import raised_everywhere

#: the values of ``on_error``
ON_ERROR = ("abort", "raise")
#: the error code passed to ``MPI_Abort`` (``mpiexec`` exits with it)
ABORT_CODE = 75


def check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, not {on_error!r}")


def stranded(exc: BaseException, comm: MPI.Comm, on_error: str,
             call: Callable[[], str]) -> None:
    """Called with an exception that escapes a collective call of ``comm``
    past its agreement: returns when it is to propagate (raised everywhere,
    one rank, ``on_error="raise"``), else stops the job (never returns).
    ``call()`` describes the call for the message."""
    if on_error == "raise" or raised_everywhere(exc) or comm.Get_size() == 1:
        return
    abort(comm, exc, call())


def abort(comm: MPI.Comm, exc: BaseException, call: str) -> None:
    """Print ``exc`` (with its traceback), the rank, the thread unless it is
    the main one (the progress thread of ``start()``) and the call, then
    ``MPI_Abort``."""
    rank, size = comm.Get_rank(), comm.Get_size()
    thread = threading.current_thread()
    where = "" if thread is threading.main_thread() else f" (thread {thread.name})"
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    text += (f"hpccomm: rank {rank} of {size}{where}: {type(exc).__name__} inside a collective "
             f"({call}): {exc}\n"
             f"hpccomm: the other ranks cannot finish this call: MPI_Abort(comm, "
             f"{ABORT_CODE}) ends the job (on_error='abort'; see docs/guide/errors.md)\n")
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 -- nothing may stop the abort
        pass
    os.write(2, text.encode("utf-8", "replace"))
    comm.Abort(ABORT_CODE)
