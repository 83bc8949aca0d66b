"""Predicted time of one allreduce per algorithm: the model behind
``algorithm="auto"``.

A *profile* is what ``python -m hpccomm.bench calibrate`` measured on one
machine and communicator size, as JSON::

    {"format": 1,
     "machine": {"hosts": "<hash of the sorted host names>", "ranks": P, "mpi": "..."},
     "patterns": {"allreduce":  [[bytes, seconds], ...],
                  "alltoallv":  [[bytes, seconds], ...],
                  "allgatherv": [[bytes, seconds], ...]},
     "kernels": {"onebit": {"encode": [a, b], "owner": [a, b], "decode": [a, b]}, ...},
     "overhead": seconds}

Patterns: the median time of the slowest rank for a ladder of message sizes,
``bytes`` being what one rank contributes (``allreduce``: its vector;
``alltoallv``: its block for each peer; ``allgatherv``: its block).  Between
two measured sizes the time is interpolated linearly, beyond the largest it
grows with the last two points' slope (the ``beta`` of an alpha-beta fit),
below the smallest it is the smallest's time (``alpha``).

Kernels: ``seconds = a + b n`` for ``n`` float32 elements -- ``encode``: the
worker's encode (with error feedback where the codec fuses it), ``owner``: the
owner step on a chunk of ``n`` with two packets, ``decode``: one decode.
``overhead``: the Python around one compressed call (seconds).

Without a profile (or with one that cannot be read) the built-in
:data:`DEFAULT` applies: this package's measurements on a 2-core shared-memory
machine, where dense ``MPI_Allreduce`` is the fastest at every size -- so
``auto`` sends dense until a calibration says compression pays.
"""
from __future__ import annotations

import bisect
import copy
import json
import math
import os
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

FORMAT = 1
PATTERNS = ("allreduce", "alltoallv", "allgatherv")
KERNELS = ("encode", "owner", "decode")

#: built-in numbers (shared memory, P = 2, MPICH, one thread per rank), used
#: without a profile: bytes -> seconds per pattern, a + b n per kernel
DEFAULT: dict = {
    "format": FORMAT,
    "machine": {"hosts": "default", "ranks": 0, "mpi": "default"},
    "patterns": {
        "allreduce": [[8, 2.5e-6], [4096, 5e-6], [1 << 20, 4.5e-4], [64 << 20, 3.8e-2]],
        "alltoallv": [[8, 2.5e-6], [4096, 4e-6], [1 << 20, 1.5e-4], [32 << 20, 1.2e-2]],
        "allgatherv": [[8, 2.5e-6], [4096, 4e-6], [1 << 20, 1.5e-4], [32 << 20, 1.2e-2]],
    },
    # per float32 element: ~3 GB/s encode with feedback, owner ~1.5 ns, decode ~0.6 ns
    "kernels": {"*": {"encode": [4e-6, 1.3e-9], "owner": [1e-5, 1.5e-9],
                      "decode": [3e-6, 6e-10]}},
    "overhead": 4e-5,
}


class ProfileError(ValueError):
    """A profile file that does not follow the schema above."""


def _points(value, name) -> List[Tuple[float, float]]:
    if not isinstance(value, list) or not value:
        raise ProfileError(f"pattern {name!r}: expected a list of [bytes, seconds]")
    pts = []
    for item in value:
        if (not isinstance(item, (list, tuple)) or len(item) != 2
                or not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
                           for v in item)):
            raise ProfileError(f"pattern {name!r}: bad point {item!r}")
        pts.append((float(item[0]), float(item[1])))
    pts.sort()
    return pts


def validate(data) -> dict:
    """``data`` checked against the schema (raises :class:`ProfileError`)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f"not a format-{FORMAT} hpccomm profile")
    patterns = data.get("patterns")
    if not isinstance(patterns, dict) or any(p not in patterns for p in PATTERNS):
        raise ProfileError(f"a profile needs the patterns {', '.join(PATTERNS)}")
    for name in PATTERNS:
        _points(patterns[name], name)
    kernels = data.get("kernels")
    if not isinstance(kernels, dict) or not kernels:
        raise ProfileError("a profile needs kernel costs")
    for codec, costs in kernels.items():
        if not isinstance(costs, dict) or any(
                not (isinstance(costs.get(k), list) and len(costs[k]) == 2
                     and all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
                             for v in costs[k])) for k in KERNELS):
            raise ProfileError(f"kernel costs of {codec!r}: expected {list(KERNELS)} as [a, b]")
    overhead = data.get("overhead", 0.0)
    if not isinstance(overhead, (int, float)) or not math.isfinite(overhead) or overhead < 0:
        raise ProfileError("overhead must be a non-negative number of seconds")
    return data


def profile_path(hosts: str, ranks: int) -> str:
    """Where a profile lives: ``$HPCCOMM_PROFILE`` when set, else
    ``$XDG_CACHE_HOME/hpccomm`` (``~/.cache/hpccomm``) keyed by host set and P."""
    env = os.environ.get("HPCCOMM_PROFILE")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hpccomm", f"profile-{hosts}-P{ranks}.json")


def load(path: Optional[str]) -> Tuple[dict, str]:
    """``(profile, source)``: the file at ``path``, or :data:`DEFAULT` when
    there is none -- with a warning when it exists but cannot be used."""
    if path and os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                return validate(json.load(f)), path
        except (OSError, ValueError) as exc:
            warnings.warn(f"hpccomm: ignoring the profile {path}: {exc}; using the built-in "
                          "defaults", RuntimeWarning, stacklevel=2)
    return copy.deepcopy(DEFAULT), "defaults"


def save(profile: dict, path: str) -> None:
    validate(profile)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(profile, f, indent=1)
    os.replace(tmp, path)


class CostModel:
    """Predictions from one (validated) profile; the same numbers give the
    same predictions on every rank."""

    def __init__(self, profile: dict):
        validate(profile)
        self.profile = profile
        self._pts = {p: _points(profile["patterns"][p], p) for p in PATTERNS}
        self.overhead = float(profile.get("overhead", 0.0))

    # -- building blocks ---------------------------------------------------
    def pattern(self, name: str, nbytes: float) -> float:
        """Seconds of one ``name`` collective moving ``nbytes`` per rank."""
        pts = self._pts[name]
        xs = [p[0] for p in pts]
        if nbytes <= xs[0]:
            return pts[0][1]
        i = bisect.bisect_left(xs, nbytes)
        if i == len(pts):
            i = len(pts) - 1
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        slope = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
        return max(y0 + slope * (nbytes - x0), 0.0)

    def kernel(self, codec: str, step: str, n: float) -> float:
        kernels = self.profile["kernels"]
        a, b = (kernels.get(codec) or kernels.get("*") or DEFAULT["kernels"]["*"])[step]
        return a + b * n if n > 0 else 0.0

    # -- algorithms --------------------------------------------------------
    def dense(self, n: int, itemsize: int = 4) -> float:
        return self.pattern("allreduce", n * itemsize)

    def twoshot(self, codec: str, n: int, P: int, chunk_bytes: float,
                segments: int = 1) -> float:
        m = n / P
        kernels = (self.kernel(codec, "encode", n) + self.kernel(codec, "owner", m)
                   + max(P - 2, 0) * self.kernel(codec, "decode", m)
                   + self.kernel(codec, "decode", n - m))
        wire = self.pattern("alltoallv", chunk_bytes) + self.pattern("allgatherv", chunk_bytes)
        if segments > 1:
            return self.overhead + max(kernels, wire) + min(kernels, wire) / segments
        return self.overhead + kernels + wire

    def allgather(self, codec: str, n: int, P: int, packet_bytes: float) -> float:
        return (self.overhead + self.kernel(codec, "encode", n)
                + self.pattern("allgatherv", packet_bytes)
                + P * self.kernel(codec, "decode", n))

    def summable(self, codec: str, n: int, P: int, code_bytes: float) -> float:
        return (self.overhead + self.kernel(codec, "encode", n)
                + self.pattern("allreduce", code_bytes) + self.kernel(codec, "decode", n))

    def fit_kernel(self, codec: str, samples: Sequence[Tuple[int, Dict[str, float]]]) -> None:
        """Set ``codec``'s ``a + b n`` from two or more ``(n, {step: seconds})``."""
        samples = sorted(samples)
        (n0, t0), (n1, t1) = samples[0], samples[-1]
        costs = {}
        for step in KERNELS:
            b = max((t1[step] - t0[step]) / (n1 - n0), 0.0) if n1 > n0 else 0.0
            costs[step] = [max(t0[step] - b * n0, 0.0), b]
        self.profile["kernels"][codec] = costs
