"""Counter-based random numbers: the same value for the same
``(seed, rank, step, index)`` on any thread count, chunking or device.

A *stream key* is derived once per encode call from ``(seed, rank, step)``
(:func:`stream_key`, plain Python); element ``i`` then draws
``mix64(key + (i + 1) * GOLDEN)`` -- the SplitMix64 output function applied to
a Weyl sequence, which passes BigCrush as a generator and is a good hash of
the counter.  :func:`uniform01` keeps the top 24 bits, so the float32 is exact:
``u = (h >> 40) * 2**-24`` in ``[0, 1)``.

The element functions are plain Python on uint64 values so that the same source
compiles with ``numba.njit`` (here) and ``numba.cuda.jit(device=True)``
(:mod:`hpccomm.kernels.cuda_quantize`): CPU and GPU kernels draw identical bits.
"""
import functools

import numpy as np
from numba import njit

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB

U64_GOLDEN = np.uint64(GOLDEN)
U64_C1 = np.uint64(_C1)
U64_C2 = np.uint64(_C2)
U64_ONE = np.uint64(1)
U64_30 = np.uint64(30)
U64_27 = np.uint64(27)
U64_31 = np.uint64(31)
U64_40 = np.uint64(40)
F32_2M24 = np.float32(1.0 / (1 << 24))


def _mix64_py(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * _C1) & M64
    z = ((z ^ (z >> 27)) * _C2) & M64
    return z ^ (z >> 31)


_G2, _G3, _G5 = 2 * GOLDEN, 3 * GOLDEN, 5 * GOLDEN


def stream_key(seed: int, rank: int, step: int, salt: int = 0) -> np.uint64:
    """The 64-bit key of one encode call: ``mix64`` of ``seed + GOLDEN``,
    then of that xor ``rank + 2 GOLDEN``, ``step + 3 GOLDEN`` and ``salt +
    5 GOLDEN`` in turn (each mod 2**64).  ``salt`` separates independent
    uses within one call (e.g. sampling vs rounding)."""
    z = _mix64_py(_rank_prefix(int(seed), int(rank)) ^ ((int(step) + _G3) & M64))
    return np.uint64(_mix64_py(z ^ ((int(salt) + _G5) & M64)))


@functools.lru_cache(maxsize=4096)
def _rank_prefix(seed: int, rank: int) -> int:
    """The part of :func:`stream_key` that depends on ``(seed, rank)`` alone,
    kept: a repeated call draws a key per rank it encodes as, and the two
    mixes are half of a key's 2 us in Python."""
    return _mix64_py(_mix64_py(seed + GOLDEN) ^ ((rank + _G2) & M64))


def hash_index(key, i):
    """64 random bits for global element index ``i`` (uint64) under ``key``.

    Self-contained (no calls) so that numba.njit and numba.cuda.jit both
    compile this very source."""
    z = key + (i + U64_ONE) * U64_GOLDEN
    z = (z ^ (z >> U64_30)) * U64_C1
    z = (z ^ (z >> U64_27)) * U64_C2
    return z ^ (z >> U64_31)


def uniform01(key, i):
    """A float32 uniform in [0, 1) for element ``i``; exact in float32."""
    z = key + (i + U64_ONE) * U64_GOLDEN
    z = (z ^ (z >> U64_30)) * U64_C1
    z = (z ^ (z >> U64_27)) * U64_C2
    z = z ^ (z >> U64_31)
    return np.float32(z >> U64_40) * F32_2M24


def weyl(key, i):
    """The counter of element ``i``: ``key + (i + 1) * GOLDEN``.  Element
    ``i + 1``'s is this ``+ GOLDEN``, so a loop over consecutive elements
    advances it by one addition (a vector induction variable: no multiply)."""
    return key + (i + U64_ONE) * U64_GOLDEN


def bits24_weyl(z):
    """The top 24 bits of ``mix64(z)`` for the counter ``z = weyl(key, i)``:
    ``uniform01(key, i) * 2**24``, an integer in ``[0, 2**24)`` (uint64)."""
    z = (z ^ (z >> U64_30)) * U64_C1
    z = (z ^ (z >> U64_27)) * U64_C2
    z = z ^ (z >> U64_31)
    return z >> U64_40


def uniform01_weyl(z):
    """:func:`uniform01` from the counter ``z = weyl(key, i)``: the same float32."""
    z = (z ^ (z >> U64_30)) * U64_C1
    z = (z ^ (z >> U64_27)) * U64_C2
    z = z ^ (z >> U64_31)
    return np.float32(z >> U64_40) * F32_2M24


hash_index_cpu = njit(cache=True, inline="always")(hash_index)
uniform01_cpu = njit(cache=True, inline="always")(uniform01)
weyl_cpu = njit(cache=True, inline="always")(weyl)
uniform01_weyl_cpu = njit(cache=True, inline="always")(uniform01_weyl)
bits24_weyl_cpu = njit(cache=True, inline="always")(bits24_weyl)


@njit(cache=True, nogil=True)
def uniform_array(key, offset, n):
    """``n`` uniforms for global indices ``offset .. offset + n - 1`` (for tests
    and numpy reference code)."""
    out = np.empty(n, dtype=np.float32)
    base = np.uint64(offset)
    for i in range(n):
        out[i] = uniform01_cpu(key, base + np.uint64(i))
    return out
