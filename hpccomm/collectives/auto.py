"""``auto``: per call, the fastest of the algorithms that carry the codec and
of dense ``MPI_Allreduce``, as the cost model predicts it.

1. On its first call the algorithm asks rank 0 for its profile
   (:mod:`hpccomm.cost_model`: the file ``python -m hpccomm.bench calibrate``
   wrote for this host set and P, or the built-in defaults) and every rank
   keeps rank 0's numbers: decisions are made from shared numbers only, so
   they are the same on every rank.
2. Per ``(n, shape)`` (cached) it predicts the time of ``dense`` (the values
   as they are, one ``MPI_Allreduce``), ``twoshot`` (with its segments) and
   ``allgather``, and takes the
   fastest -- a compressed one only when predicted :data:`MARGIN` (10 %)
   faster than dense (ties: the earlier in that order).  ``summable`` is not a
   candidate: its encode is not the codec's calibrated kernel.
3. A ``policy`` -- ``{key pattern: choice}``, ``fnmatch`` patterns, the first
   match wins -- overrides the model for matching keys (e.g.
   ``{"classifier.*": "dense"}``).
4. ``dense`` sends ``x`` itself: lossless, and with error feedback the
   residual stays as it was (the codec's choice of *what* to lose is the
   user's; the choice of *whether* compression pays is hpccomm's).  Any other
   choice runs that algorithm -- the same bits as calling it directly.

The choice is in ``stats.last.extra["auto"]``; ``HPCCOMM_LOG=auto`` logs every
new decision with the predicted times (logger ``hpccomm.auto``).
"""
from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
from typing import Dict, Optional

from mpi4py import MPI

from .. import cost_model
from ..communicators import spans_one_node
from .base import Algorithm, get_algorithm_class, register_algorithm

#: what auto chooses from (``summable`` is left out: its encode is not the
#: codec's calibrated kernel, and measured it was far slower than predicted)
CHOICES = ("dense", "twoshot", "allgather")

#: a compressed choice must be predicted this much faster than dense: where the
#: two are close the model's error (measured: ~15 % on shared memory) decides,
#: and dense is the safe side (lossless, no residual to carry)
MARGIN = 0.10
#: decisions remembered, by (length, shape); forgotten all at once beyond it (a
#: decision is recomputed from the model alike on every rank)
DECISIONS_KEPT = 4096

log = logging.getLogger("hpccomm.auto")
if "auto" in os.environ.get("HPCCOMM_LOG", "").split(","):
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("hpccomm.auto: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.DEBUG)


def host_set_key(comm: MPI.Comm) -> str:
    """A short hash of the sorted host names of ``comm`` (collective)."""
    names = sorted(set(comm.allgather(MPI.Get_processor_name())))
    return hashlib.blake2b(",".join(names).encode(), digest_size=6).hexdigest()


def host_set_name(comm: MPI.Comm) -> str:
    """What a profile of ``comm`` is keyed by: :func:`host_set_key`, or
    ``local`` for one rank (collective)."""
    return host_set_key(comm) if comm.Get_size() > 1 else "local"


def profile_location(comm: MPI.Comm, hosts: Optional[str] = None) -> str:
    """The profile file ``auto`` on ``comm`` looks for (rank 0 reads it):
    keyed by ``hosts`` (default :func:`host_set_name`, collective) and the size."""
    return cost_model.profile_path(hosts or host_set_name(comm), comm.Get_size())


@register_algorithm
class Auto(Algorithm):
    name = "auto"

    def __init__(self, comm, codec, policy: Optional[Dict[str, str]] = None):
        super().__init__(comm, codec)
        policy = dict(policy or {})
        for pattern, choice in policy.items():
            if not isinstance(pattern, str) or choice not in CHOICES:
                raise ValueError(f"auto: policy maps key patterns to one of {CHOICES}, "
                                 f"not {pattern!r}: {choice!r}")
        self.policy = policy
        self._candidates = {}
        for name in CHOICES[1:]:
            try:
                self._candidates[name] = get_algorithm_class(name)(comm, codec)
            except ValueError:      # this algorithm cannot carry the codec
                continue
        for choice in set(policy.values()) - {"dense"} - set(self._candidates):
            raise ValueError(f"auto: policy asks for {choice!r}, which cannot carry codec "
                             f"{codec.name!r}")
        self.model: Optional[cost_model.CostModel] = None
        self.source = None
        self._decided: Dict[tuple, str] = {}

    def params(self):
        return {"policy": ",".join(f"{k}:{v}" for k, v in self.policy.items()) or "-"}

    # -- the decision --------------------------------------------------------
    def _load(self, net) -> None:
        """Rank 0's profile on every rank (collective, once)."""
        profile = source = None
        path = profile_location(net.comm)
        if self.rank == 0:
            profile, source = cost_model.load(path)
        profile, source = net.bcast_object((profile, source))
        self.model, self.source = cost_model.CostModel(profile), source
        twoshot = self._candidates.get("twoshot")
        if twoshot is not None and self.size > 1:   # its segments depend on the node layout
            twoshot._one_node = spans_one_node(net.comm)

    def predict(self, n: int, shape: tuple) -> Dict[str, float]:
        """Predicted seconds per choice for ``n`` elements of ``shape``."""
        times = {"dense": self.model.dense(n)}
        if self.size == 1:
            return times
        for choice, alg in self._candidates.items():
            segments = alg.segment_count(n, shape) if choice == "twoshot" else 1
            times[choice] = cost_model.predict(self.model, self.codec, choice, n, self.size,
                                               shape, segments)
        return times

    def choose(self, n: int, shape: tuple, key: Optional[str] = None) -> str:
        for pattern, choice in self.policy.items():
            if key is not None and fnmatch.fnmatchcase(key, pattern):
                return choice
        cached = self._decided.get((n, shape))
        if cached is None:
            times = self.predict(n, shape)
            scored = {c: t if c == "dense" else t / (1 - MARGIN) for c, t in times.items()}
            cached = min(scored, key=lambda c: (scored[c], CHOICES.index(c)))
            if len(self._decided) >= DECISIONS_KEPT:     # sizes that come and go
                self._decided.clear()
            self._decided[(n, shape)] = cached
            log.debug("rank %d: n=%d P=%d codec=%s -> %s (%s; profile: %s)", self.rank, n,
                      self.size, self.codec.name, cached,
                      ", ".join(f"{c} {t * 1e3:.3f} ms" for c, t in times.items()),
                      self.source)
        return cached

    def _settled(self, n: int, shape: tuple) -> Optional[Algorithm]:
        """The compressed algorithm chosen for ``(n, shape)``, once the
        decision is known and no per-key policy could change it; else None."""
        choice = None if self.policy else self._decided.get((n, tuple(shape)))
        return self._candidates.get(choice)

    def checks_after_encode(self, n: int, shape: tuple) -> bool:
        alg = self._settled(n, shape)
        return alg is not None and alg.checks_after_encode(n, shape)

    def repeat_plan(self, comm, n, shape, state, memory, deferred):
        """The chosen algorithm's plan for the key (``twoshot``'s), once it is
        :meth:`_settled`: a repeated call then runs as the algorithm called
        directly would, with the choice in its statistics as before."""
        alg = self._settled(n, shape)
        return None if alg is None else alg.repeat_plan(comm, n, shape, state, memory, deferred)

    def sends_dense(self, n, shape, key):
        return self.model is not None and self.choose(n, tuple(shape), key) == "dense"

    # -- the call ----------------------------------------------------------
    def decide(self, n: int, shape: tuple, key: Optional[str], net) -> str:
        """This call's choice (the profile is loaded on the first call: collective)."""
        if self.model is None:
            self._load(net)
        return self.choose(n, tuple(shape), key)

    def candidate(self, name: str) -> Algorithm:
        """The algorithm behind choice ``name`` (not ``"dense"``)."""
        return self._candidates[name]

    def reduce(self, x, out, state, ctx):
        choice = self.decide(x.size, ctx.shape, ctx.key, ctx.net)
        ctx.call.extra["auto"] = choice
        if choice == "dense":
            if ctx.agree is not None:   # (cannot happen: the check is deferred only
                ctx.agree(None)         # for a known compressed choice)
            if self.size == 1 or x.size == 0:
                out[...] = x
            else:
                ctx.net.allreduce(x, out)
            return
        self._candidates[choice].reduce(x, out, state, ctx)

