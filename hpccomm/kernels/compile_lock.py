"""One compiler per kernel among the processes that share numba's cache.

Every kernel of hpccomm is compiled on first use (``@njit(cache=True)``) and
kept in numba's on-disk cache.  On a fresh install, every rank of a node that
starts at once compiles every kernel it calls: 64 ranks spend 64 times the
CPU of one, on cores they share, and their saves of one kernel's cache index
race (an entry lost is compiled again by the next process).

With ``HPCCOMM_COMPILE_LOCK=1`` (set before hpccomm is imported), the
compilation of each of hpccomm's kernels holds an exclusive lock file beside
the kernel's cache files, ``<module>.<function>-<line>.lock`` in its
``cache_path``: the first process compiles and saves, the others wait for it
and load what it saved.  Only kernels of hpccomm's own modules with caching on
are locked; other numba functions compile as before.

Locks follow calls: compiling a kernel may compile the kernels it calls
(holding the caller's lock while taking the callee's), and a kernel's calls
form no cycle, so two processes cannot wait on each other.  Within a process
numba's compiler lock is taken first, so the file lock is never waited for
by two threads of one process, and a lock this process already holds is not
taken twice.  Where the file system refuses locks (``OSError``), the kernel
compiles unlocked, as without this module.

A signature already in the cache is loaded without the lock, by any number
of processes at once (numba replaces cache files atomically); only a miss
takes the lock, and then looks in the cache again before compiling.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Dict, Optional

from numba.core import dispatcher as _dispatcher
from numba.core.compiler_lock import global_compiler_lock

#: the environment variable that turns the lock on (``1``, ``true``, ``yes``)
ENV = "HPCCOMM_COMPILE_LOCK"
_PACKAGE = __name__.split(".")[0]

_original = None
_held: Dict[str, int] = {}      # lock path -> depth, in this process


def requested() -> bool:
    """Whether :data:`ENV` asks for the lock."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def lock_path(disp) -> Optional[str]:
    """The lock file of a dispatcher's compilations: None unless it is one of
    hpccomm's kernels and numba caches it on disk."""
    func = getattr(disp, "py_func", None)
    module = getattr(func, "__module__", "") or ""
    if module != _PACKAGE and not module.startswith(_PACKAGE + "."):
        return None
    cache = getattr(disp, "_cache", None)
    path = getattr(cache, "cache_path", None)
    if path is None or not getattr(cache, "_enabled", False):
        return None
    line = func.__code__.co_firstlineno
    return os.path.join(path, f"{module}.{func.__qualname__}-{line}.lock")


@contextlib.contextmanager
def _locked(path: str):
    if _held.get(path):                 # a caller's compile in this process holds it
        _held[path] += 1
        try:
            yield
        finally:
            _held[path] -= 1
        return
    f = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        f = open(path, "a")
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    except OSError:                     # no locks here: compile as without them
        if f is not None:
            f.close()
        f = None
    _held[path] = 1
    try:
        yield
    finally:
        del _held[path]
        if f is not None:
            f.close()                   # closing the file releases the lock


class _Miss(Exception):
    """Raised in place of compiling: the signature is not in the cache."""


@contextlib.contextmanager
def _loads_only(disp, sig):
    """numba's compile without its compiler: an overload already built or in
    the cache returns as usual, a miss raises :class:`_Miss` (and is not
    counted in ``disp.stats``: the compile that follows counts it)."""
    def miss(args, return_type):
        raise _Miss
    disp._compiler.compile = miss           # this dispatcher only; under numba's lock
    try:
        yield
    except _Miss:
        misses = disp._cache_misses
        misses[sig] -= 1
        if not misses[sig]:
            del misses[sig]
        raise
    finally:
        del disp._compiler.compile


def _compile(self, sig):
    path = lock_path(self)
    if path is None or not hasattr(self, "_compiler") or not hasattr(self, "_cache_misses"):
        return _original(self, sig)     # (a numba whose dispatchers are built otherwise)
    with global_compiler_lock:
        try:                    # cached: load without the lock, as many processes at once
            with _loads_only(self, sig):
                return _original(self, sig)
        except _Miss:
            pass
        with _locked(path):     # the first to get here compiles; the others load its result
            return _original(self, sig)


def install() -> None:
    """Lock the compilation of hpccomm's kernels (idempotent)."""
    global _original
    if _original is None:
        _original = _dispatcher.Dispatcher.compile
        _dispatcher.Dispatcher.compile = _compile


def installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _original is not None
