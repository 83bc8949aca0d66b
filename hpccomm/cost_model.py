"""Predicted time of one allreduce per algorithm: the model behind
``algorithm="auto"``.

A *profile* is what ``python -m hpccomm.bench calibrate`` measured on one
machine and communicator size, as JSON::

    {"format": 2,
     "machine": {"hosts": "<hash of the sorted host names>", "ranks": P, "mpi": "..."},
     "patterns": {"allreduce":  [[bytes, seconds], ...],
                  "alltoallv":  [[bytes, seconds], ...],
                  "allgatherv": [[bytes, seconds], ...]},
     "kernels": {"onebit": {"encode": [[n, seconds], ...], "owner": [...],
                            "decode": [...]}, ...},
     "overhead": {"dense": seconds, "twoshot": seconds, "allgather": seconds},
     "calls": {"onebit": {"twoshot": [[n, seconds], ...], "allgather": ...}, ...},
                                                             (optional; signed; or one number)
     "waits": [[seconds of kernels, seconds waited], ...],                    (optional)
     "overlap": share of a transfer that runs under a compute phase, 0..1 (optional)
     "oversubscription": ranks per core on the busiest node (optional, >= 1)}

Patterns: the median time of the slowest rank for a ladder of message sizes,
``bytes`` being what one rank contributes (``allreduce``: its vector;
``alltoallv``: its block for each peer; ``allgatherv``: its block).  Between
two measured sizes the time is interpolated linearly, beyond the largest it
grows with the last two points' slope (the ``beta`` of an alpha-beta fit),
below the smallest it is the smallest's time (``alpha``).

Kernels: the same kind of ladder over ``n`` float32 elements, interpolated the
same way (in cache and beyond it they run at different speeds) -- ``encode``:
the worker's encode (with error feedback where the codec fuses it),
``owner``: the owner step on a chunk of ``n`` with two packets, ``decode``: one
decode; ``"*"`` is the fallback for codecs not measured.  Every rank of the
communicator runs the kernel at the same moment (a barrier before each
repetition) and the slowest rank's time counts, as inside a collective: with
more ranks than cores on a node, or ranks sharing a memory bus, the kernels are
measured sharing them, so the profile of ``P`` ranks carries the kernel terms
of its ranks per core.  ``oversubscription`` records that number; format 1
profiles, whose kernels were not measured in step, are scaled by it instead.

Waits: a collective that follows a compute phase waits for the ranks still
computing; where ranks share cores, the scheduler can hold one back for a time
slice, and the wait grows with the phase (measured: about the phase itself at
3 ranks on 2 cores below a few milliseconds).  ``waits`` is that wait against
the length of the phase before it, interpolated like the patterns; with one
rank per core it is about zero.  ``twoshot`` adds one after the encodes and one
after the owner step (per segment), ``allgather`` one after the encode.

Overlap: ``twoshot`` in ``S`` segments runs one segment's transfers while the
next is encoded.  ``overlap`` is the share of the shorter of the two that this
hides, measured (a nonblocking all-to-all under a compute phase as long); where
the link's protocol needs the cores the kernels hold (TCP on a busy node) it is
well below 1.  The pipelined call takes ``kernels + wire - overlap * min(kernels,
wire) * (1 - 1/S)``; 1 (the default) is full overlap.

Per-call cost: ``overhead`` is the Python of one call per algorithm with the
``none`` codec (for ``dense``: the reducer's lean path); ``calls[codec][alg]``
the same for a codec's own calls (validation, packet headers, dispatch into its
kernels), measured as a call's time outside MPI (its statistics' ``t_comm``
taken off: the time inside MPI is the patterns' and waits' term) less the
kernels predicted for it, on a ladder of small sizes (``[[n, seconds], ...]``,
interpolated in ``n`` and held beyond both ends; a single number, as older
profiles have it, holds for every ``n``).  It may be negative: the kernel terms
time each kernel through its codec call, with that call's Python, and a
repeated call whose plan runs the kernels alone (``twoshot``'s laid-out plan
and slot kernels) skips it -- by how much depends on ``n`` and ``P``, since
the plan runs only up to a size and makes ``2 P`` kernel calls; a negative
term takes back at most the call's kernels.  A codec without an entry gets ``overhead``.

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
from typing import List, Optional, Tuple

FORMAT = 2
#: formats :func:`validate` accepts (1: kernels scaled by ``oversubscription``)
FORMATS = (1, 2)
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
    # ~3 GB/s encode with feedback, owner ~1.5 ns and decode ~0.6 ns per element
    "kernels": {"*": {"encode": [[4096, 1e-5], [1 << 24, 2.2e-2]],
                      "owner": [[4096, 1.6e-5], [1 << 24, 2.5e-2]],
                      "decode": [[4096, 5e-6], [1 << 24, 1e-2]]}},
    "overhead": {"dense": 1e-5, "twoshot": 6e-5, "allgather": 3e-5},
}
ALGORITHMS = ("dense", "twoshot", "allgather")


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
    if not isinstance(data, dict) or data.get("format") not in FORMATS:
        raise ProfileError(f"not an hpccomm profile of format {' or '.join(map(str, FORMATS))}")
    patterns = data.get("patterns")
    if not isinstance(patterns, dict) or any(p not in patterns for p in PATTERNS):
        raise ProfileError(f"a profile needs the patterns {', '.join(PATTERNS)}")
    for name in PATTERNS:
        _points(patterns[name], name)
    kernels = data.get("kernels")
    if not isinstance(kernels, dict) or not kernels:
        raise ProfileError("a profile needs kernel costs")
    for codec, costs in kernels.items():
        if not isinstance(costs, dict) or any(k not in costs for k in KERNELS):
            raise ProfileError(f"kernel costs of {codec!r}: expected {list(KERNELS)}")
        for step in KERNELS:
            _points(costs[step], f"{codec}.{step}")
    over = data.get("oversubscription", 1.0)
    if not isinstance(over, (int, float)) or not math.isfinite(over) or over < 1:
        raise ProfileError("oversubscription must be a number >= 1")
    overhead = data.get("overhead")
    if not isinstance(overhead, dict) or any(
            not isinstance(overhead.get(a), (int, float)) or not math.isfinite(overhead[a])
            or overhead[a] < 0 for a in ALGORITHMS):
        raise ProfileError(f"overhead must give seconds >= 0 for {', '.join(ALGORITHMS)}")
    if "waits" in data:
        _points(data["waits"], "waits")
    share = data.get("overlap", 1.0)
    if not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise ProfileError("overlap must be a number from 0 to 1")
    calls = data.get("calls", {})
    if not isinstance(calls, dict) or any(
            not isinstance(per, dict) or any(
                a not in ALGORITHMS[1:] or not _call_term(t) for a, t in per.items())
            for per in calls.values()):
        raise ProfileError("calls must map codecs to {algorithm: finite seconds, or "
                           "[[n, seconds], ...] with n > 0 ascending} for "
                           f"{', '.join(ALGORITHMS[1:])}")
    return data


def _call_term(t) -> bool:
    """Whether ``t`` is a per-call term: finite seconds (signed), or a ladder
    ``[[n, seconds], ...]`` of them over ascending ``n > 0``."""
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        return math.isfinite(t)
    if not isinstance(t, list) or not t:
        return False
    ns = []
    for p in t:
        if (not isinstance(p, (list, tuple)) or len(p) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                           and math.isfinite(v) for v in p) or p[0] <= 0):
            return False
        ns.append(p[0])
    return all(a < b for a, b in zip(ns, ns[1:]))


def _signed_interpolate(pts, x: float) -> float:
    """Piecewise linear in ``x`` through ``pts`` (ascending), held beyond both ends."""
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    i = bisect.bisect_left([p[0] for p in pts], x)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


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
        self._kernels = {c: {k: _points(v[k], k) for k in KERNELS}
                         for c, v in profile["kernels"].items()}
        self.overhead = {a: float(profile["overhead"][a]) for a in ALGORITHMS}
        self.calls = {c: {a: ([(float(n), float(v)) for n, v in t] if isinstance(t, list)
                              else float(t)) for a, t in per.items()}
                      for c, per in profile.get("calls", {}).items()}
        self._waits = _points(profile["waits"], "waits") if "waits" in profile else None
        self.overlap = float(profile.get("overlap", 1.0))
        self.oversubscription = float(profile.get("oversubscription", 1.0))
        # format 2 measures the kernels in step on every rank (shared cores
        # included); format 1 measured them apart and scaled by the ranks per core
        self._kernel_scale = self.oversubscription if profile["format"] == 1 else 1.0

    # -- building blocks ---------------------------------------------------
    @staticmethod
    def _interpolate(pts, x: float) -> float:
        xs = [p[0] for p in pts]
        if x <= xs[0] or len(pts) == 1:
            return pts[0][1] if x <= xs[0] else pts[-1][1]
        i = min(bisect.bisect_left(xs, x), len(pts) - 1)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        slope = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
        return max(y0 + slope * (x - x0), 0.0)

    def pattern(self, name: str, nbytes: float) -> float:
        """Seconds of one ``name`` collective moving ``nbytes`` per rank."""
        return self._interpolate(self._pts[name], nbytes)

    def kernel(self, codec: str, step: str, n: float) -> float:
        costs = self._kernels.get(codec) or self._kernels.get("*")
        if costs is None:
            costs = {k: _points(v, k) for k, v in DEFAULT["kernels"]["*"].items()}
        return self._kernel_scale * self._interpolate(costs[step], n) if n > 0 else 0.0

    def wait(self, compute: float) -> float:
        """Seconds a collective waits after a phase of ``compute`` seconds of
        kernels on every rank (the profile's ``waits``; 0 without)."""
        if self._waits is None or compute <= 0:
            return 0.0
        return self._interpolate(self._waits, compute)

    def call_overhead(self, codec: str, algorithm: str, n: float = 0) -> float:
        """Seconds of Python per call of ``algorithm`` with ``codec`` on ``n``
        elements (signed; see the module docstring)."""
        t = self.calls.get(codec, {}).get(algorithm)
        if t is None:
            return self.overhead[algorithm]
        return _signed_interpolate(t, n) if isinstance(t, list) else t

    # -- algorithms: the terms of a call -----------------------------------
    # Each returns {"overhead", "kernels", "comm"}, which add up to the
    # prediction; "comm" is the time in MPI that no kernel hides.
    def dense_terms(self, n: int, itemsize: int = 4, reducer: bool = True) -> dict:
        """``MPI_Allreduce`` of ``n`` values (``reducer``: through the lean path)."""
        return {"overhead": self.overhead["dense"] if reducer else 0.0, "kernels": 0.0,
                "comm": self.pattern("allreduce", n * itemsize)}

    def twoshot_terms(self, codec: str, n: int, P: int, chunk_bytes: float,
                      segments: int = 1) -> dict:
        m = n / P
        encodes = P * self.kernel(codec, "encode", m)        # P chunk encodes
        owner = (self.kernel(codec, "owner", m)              # two packets measured,
                 + max(P - 2, 0) * self.kernel(codec, "decode", m))   # a decode-add more each
        kernels = encodes + owner + (P - 1) * self.kernel(codec, "decode", m)  # other chunks
        wire = self.pattern("alltoallv", chunk_bytes) + self.pattern("allgatherv", chunk_bytes)
        if segments > 1:     # all but one segment of the shorter hidden, at ``overlap``
            wire -= self.overlap * min(kernels, wire) * (1 - 1 / segments)
        waits = segments * (self.wait(encodes / segments) + self.wait(owner / segments))
        return self._terms(self.call_overhead(codec, "twoshot", n), kernels, wire + waits)

    def allgather_terms(self, codec: str, n: int, P: int, packet_bytes: float) -> dict:
        encode = self.kernel(codec, "encode", n)
        return self._terms(self.call_overhead(codec, "allgather", n),
                           encode + P * self.kernel(codec, "decode", n),
                           self.pattern("allgatherv", packet_bytes) + self.wait(encode))

    @staticmethod
    def _terms(overhead: float, kernels: float, comm: float) -> dict:
        """A compressed call's terms; a negative per-call term (a call that
        skips Python the kernel terms hold) takes back at most the kernels."""
        return {"overhead": max(overhead, -kernels), "kernels": kernels, "comm": comm}

    def dense(self, n: int, itemsize: int = 4) -> float:
        return sum(self.dense_terms(n, itemsize).values())

    def twoshot(self, codec: str, n: int, P: int, chunk_bytes: float,
                segments: int = 1) -> float:
        return sum(self.twoshot_terms(codec, n, P, chunk_bytes, segments).values())

    def allgather(self, codec: str, n: int, P: int, packet_bytes: float) -> float:
        return sum(self.allgather_terms(codec, n, P, packet_bytes).values())


def wire_bytes(codec, n: int, shape: tuple) -> float:
    """The packet size of ``n`` elements (its bound for data-dependent codecs)."""
    size = codec.wire_size_for(n, shape)
    return float(size if size is not None else codec.max_wire_size(n))


def predict_terms(model: CostModel, codec, algorithm: str, n: int, P: int, shape: tuple,
                  segments: int = 1) -> Optional[dict]:
    """The terms (``overhead``, ``kernels``, ``comm``: seconds) of one call of
    ``algorithm`` -- ``dense`` or ``mpi`` (through the reducer),
    ``MPI_Allreduce`` (the bare call), ``twoshot``, ``allgather`` -- with
    ``codec`` on ``n`` elements; None for an algorithm the model does not cover."""
    if algorithm in ("dense", "mpi", "MPI_Allreduce"):
        return model.dense_terms(n, reducer=algorithm != "MPI_Allreduce")
    if P == 1:
        return None
    if algorithm == "twoshot":
        return model.twoshot_terms(codec.name, n, P, wire_bytes(codec, -(-n // P), shape),
                                   segments)
    if algorithm == "allgather":
        return model.allgather_terms(codec.name, n, P, wire_bytes(codec, n, shape))
    return None


def predict(model: CostModel, codec, algorithm: str, n: int, P: int, shape: tuple,
            segments: int = 1) -> Optional[float]:
    """Predicted seconds of one call (the sum of :func:`predict_terms`)."""
    terms = predict_terms(model, codec, algorithm, n, P, shape, segments)
    return None if terms is None else sum(terms.values())
