"""The single-process reference of each algorithm's pipeline.

Given every rank's input -- gathered to one place -- :class:`Pipeline`
computes in one process, from the codec alone, what an algorithm must return
on every rank: the same encodes (with the same :class:`EncodeContext`: seed,
rank, step, offset, shape), the same sums in the same order, the same owner
re-encodes, and, call after call, the same error-feedback residuals
(``v = x + e``, ``e = v - decoded``, per rank and per owned chunk).  It is
the oracle of the test suite and of ``python -m hpccomm.bench allreduce
--check``.  It knows no MPI and no algorithm's code: an algorithm that
moves, orders or drops packets wrongly disagrees with it.

How closely a result must match (:func:`compare`):

* **bit for bit** where every sum is taken in a fixed order: ``twoshot`` and
  ``allgather`` (rank order, float32), ``summable`` with integer codes
  (order-free), ``hierarchical`` (node sums in rank order, then its outer
  algorithm), and any algorithm at ``P <= 2`` (float addition commutes);
* **within float reassociation** where MPI or a sparse algorithm sums float32
  values in an order of its own (``mpi`` and ``auto``'s dense choice,
  ``summable`` with float codes -- random-k --, and the sparse algorithms,
  from ``P = 3``): ``|result - reference| <= P eps |terms|`` elementwise, with
  ``eps = 2**-23`` and ``|terms|`` the sum of the absolute values of the
  per-rank terms -- the rounding bound of any summation order, for both.

The reference checks the pipeline, not the codec: a codec that decodes
wrongly decodes wrongly here too.  :func:`error_band` is the independent
check of the codec: the range of ``gain = <r, s> / <s, s>`` and ``rel_err =
|r - s| / |s|`` against the exact sum ``s`` that its theory allows for
i.i.d. N(0, 1) inputs -- a codec that decodes to zeros has gain 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from .codecs.base import Codec, EncodeContext
from .codecs.rotation import RotatedCodec
from .collectives.base import ALGORITHMS, chunk_bounds

#: the pipelines this module knows, by algorithm name; a subclass of one of
#: these algorithms is held to its pipeline (:func:`pipeline_of`)
DENSE = ("twoshot", "allgather", "summable")
SPARSE = ("sparse_allgather", "sparse_rd", "sparse_split", "oktopk", "sparse_op", "kylix",
          "rle_pipeline")
PIPELINES = DENSE + SPARSE + ("mpi", "hierarchical", "auto")

_EPS32 = float(np.finfo(np.float32).eps)


def pipeline_of(algorithm) -> Optional[str]:
    """The pipeline an algorithm (a registered name, class or instance) is
    held to: its own name when this module knows it, else that of the nearest
    base class it knows; None for an algorithm with no known pipeline."""
    if isinstance(algorithm, str):
        if algorithm in PIPELINES or algorithm not in ALGORITHMS:
            return algorithm if algorithm in PIPELINES else None
        algorithm = ALGORITHMS.get(algorithm)
    cls = algorithm if isinstance(algorithm, type) else type(algorithm)
    for base in cls.__mro__:
        name = base.__dict__.get("name")
        if isinstance(name, str) and name in PIPELINES:
            return name
    return None


@dataclass
class Result:
    """One reference call: the float32 ``values`` every rank must hold;
    ``exact``: whether they must match bit for bit; else ``magnitude``, the
    float64 sum over ranks of the absolute terms MPI sums in an order of its
    own (the reassociation bound is ``P eps magnitude``)."""

    values: np.ndarray
    exact: bool
    nranks: int
    magnitude: Optional[np.ndarray] = None


def compare(got, ref: Result) -> Optional[str]:
    """None when ``got`` matches the reference call ``ref`` (bit for bit, or
    within reassociation: see the module docstring), else what is wrong."""
    got = np.ascontiguousarray(got, dtype=np.float32).reshape(-1)
    want = ref.values.reshape(-1)
    if got.size != want.size:
        return f"{got.size} elements, the reference pipeline has {want.size}"
    if ref.exact:
        bad = got.view(np.uint32) != want.view(np.uint32)
        if not bad.any():
            return None
        what = "bits differ from the reference pipeline"
    else:
        slack = ref.nranks * _EPS32 * ref.magnitude
        diff = np.abs(got.astype(np.float64) - want)
        bad = ~(diff <= slack)                      # NaN counts as bad
        if not bad.any():
            return None
        what = "off the reference pipeline beyond float reassociation"
    i = int(np.flatnonzero(bad)[0])
    return (f"{what} at {int(bad.sum())} of {want.size} elements "
            f"(first at {i}: {got[i]!r}, reference {want[i]!r})")


def _context(seed, step, shape, feedback=False):
    """Encode contexts of one call; under error feedback they carry
    ``feedback`` and the encode's ``fresh`` part (the worker's input, the
    owner's received sum), as :class:`~hpccomm.collectives.base.Contribution`
    and ``twoshot``'s owner give them."""
    def ctx(r, off=0, fresh=None):
        return EncodeContext(seed=seed, rank=r, step=step, offset=off, shape=shape,
                             feedback=feedback, fresh=fresh if feedback else None)
    return ctx


class Pipeline:
    """The pipeline of ``algorithm`` with ``codec`` on ``nranks`` simulated
    ranks, called like a reducer with every rank's input: ``pipe(xs)`` is the
    :class:`Result` of one call, and successive calls advance the step and
    carry the residuals (``error_feedback=True``: the plain residual memory,
    on workers and owners alike).

    ``algorithm``: a name of :data:`PIPELINES` (or an algorithm, see
    :func:`pipeline_of`).  ``shape`` is the user's tensor shape (per-column
    codecs take their columns from it), ``seed`` and ``step`` the reducer's
    seed and the key's first step.  ``hierarchical`` needs ``nodes`` (a node
    id per rank, as its option, or as the shared-memory split found them)
    and takes ``outer``; ``auto`` needs ``choice``, the algorithm it chose
    (``"dense"``, ``"twoshot"``, ``"allgather"``).  Other options of the
    algorithms (segments, sparse tuning) do not change the result."""

    def __init__(self, codec: Codec, algorithm, nranks: int, shape: tuple = (), seed: int = 0,
                 step: int = 0, error_feedback: bool = False, nodes: Optional[Sequence] = None,
                 outer: str = "twoshot", choice: Optional[str] = None):
        name = pipeline_of(algorithm)
        if name is None:
            raise ValueError(f"no reference pipeline for algorithm {algorithm!r}")
        if name == "auto":
            if choice not in ("dense", "twoshot", "allgather"):
                raise ValueError(f"auto: the reference needs the choice made, not {choice!r}")
            name = "mpi" if choice == "dense" else choice
        self.codec, self.name, self.P = codec, name, int(nranks)
        self.shape, self.seed, self.step = tuple(shape), int(seed), int(step)
        self.feedback = bool(error_feedback) and name != "mpi"
        self.worker: Dict[int, np.ndarray] = {}        # rank -> residual of its input
        self.owner: Dict[int, np.ndarray] = {}         # rank -> residual of its owned chunk
        if name == "hierarchical":
            if nodes is None or len(nodes) != self.P:
                raise ValueError("hierarchical: the reference needs a node id per rank")
            self.nodes, self.outer = list(nodes), outer
            self.shares: Dict[Tuple[int, int], Pipeline] = {}

    def __call__(self, xs: Sequence[np.ndarray]) -> Result:
        if len(xs) != self.P:
            raise ValueError(f"{len(xs)} inputs for {self.P} ranks")
        xs = [np.ascontiguousarray(x, dtype=np.float32).reshape(-1) for x in xs]
        if len({x.size for x in xs}) > 1:
            raise ValueError("the ranks' inputs differ in length")
        ctx = _context(self.seed, self.step, self.shape, self.feedback)
        run = getattr(self, "_" + ("sparse" if self.name in SPARSE else self.name))
        result = run(xs, ctx)
        self.step += 1
        return result

    # -- error feedback (the residual memory) ---------------------------------
    def _compensate(self, slot: dict, r: int, x: np.ndarray) -> np.ndarray:
        e = slot.get(r) if self.feedback else None
        return x.copy() if e is None or e.size != x.size else x + e

    def _update(self, slot: dict, r: int, v: np.ndarray, decoded: np.ndarray) -> None:
        if self.feedback:
            slot[r] = v - decoded

    # -- the pipelines ----------------------------------------------------------
    def _twoshot(self, xs, ctx):
        codec, P, n = self.codec, self.P, xs[0].size
        out = np.empty(n, dtype=np.float32)
        if P == 1:      # no communication: the codec's round trip
            v = self._compensate(self.worker, 0, xs[0])
            codec.decode(codec.encode(v, ctx(0, 0, xs[0])), out)
            self._update(self.worker, 0, v, out)
            return Result(out, True, P)
        b = chunk_bounds(n, P, codec.align(self.shape))
        packets = []
        for r in range(P):
            v = self._compensate(self.worker, r, xs[r])
            own = [codec.encode(v[b[j]:b[j + 1]], ctx(r, b[j], xs[r][b[j]:b[j + 1]]))
                   for j in range(P)]
            packets.append(own)
            if self.feedback:
                decoded = np.empty(n, dtype=np.float32)
                for j in range(P):
                    codec.decode(own[j], decoded[b[j]:b[j + 1]])
                self._update(self.worker, r, v, decoded)
        for j in range(P):          # the owner of chunk j: rank j
            acc = np.zeros(b[j + 1] - b[j], dtype=np.float32)
            for src in range(P):    # in rank order
                codec.decode_add(packets[src][j], acc)
            w = self._compensate(self.owner, j, acc)
            codec.decode(codec.reencode(w, ctx(P + j, b[j], acc)), out[b[j]:b[j + 1]])
            self._update(self.owner, j, w, out[b[j]:b[j + 1]])
        return Result(out, True, P)

    def _allgather(self, xs, ctx):
        codec, P, n = self.codec, self.P, xs[0].size
        out = np.zeros(n, dtype=np.float32)
        packets = []
        for r in range(P):
            v = self._compensate(self.worker, r, xs[r])
            packets.append(codec.encode(v, ctx(r, 0, xs[r])))
            if self.feedback:
                self._update(self.worker, r, v, codec.decode(packets[r], np.empty(n, np.float32)))
        if P == 1:
            codec.decode(packets[0], out)
        elif getattr(codec, "decode_sum", None) is not None:
            codec.decode_sum(packets, out)
        else:
            for src in range(P):    # in rank order
                codec.decode_add(packets[src], out)
        return Result(out, True, P)

    def _summable(self, xs, ctx):
        codec, P, n = self.codec, self.P, xs[0].size
        vs = [self._compensate(self.worker, r, xs[r]) for r in range(P)]
        scales = [codec.shared_scale(v) for v in vs]
        scale = None if scales[0] is None else np.maximum.reduce(
            [np.asarray(s, dtype=np.float32) for s in scales])
        codes = [codec.to_summable(vs[r], scale, ctx(r, 0, xs[r])) for r in range(P)]
        dt = codec.summable_dtype(P)
        total = codes[0].astype(dt, copy=True)
        for c in codes[1:]:
            total += c.astype(dt)
        out = codec.from_summable(total, scale, np.empty(n, dtype=np.float32))
        exact = P <= 2 or np.issubdtype(dt, np.integer)
        magnitude = None if exact else np.zeros(n)
        for r in range(P):
            if self.feedback or not exact:
                own = codec.from_summable(codes[r], scale, np.empty(n, dtype=np.float32))
                self._update(self.worker, r, vs[r], own)
                if not exact:
                    magnitude += np.abs(own)
        return Result(out, exact, P, magnitude)

    def _sparse(self, xs, ctx):
        codec, P, n = self.codec, self.P, xs[0].size
        out = np.zeros(n, dtype=np.float32)
        magnitude = np.zeros(n)
        for r in range(P):
            v = self._compensate(self.worker, r, xs[r])
            dense = sparse_terms(codec, v, ctx(r, 0, xs[r]))
            out += dense            # rank order; the algorithm's order may differ
            magnitude += np.abs(dense)
            self._update(self.worker, r, v, dense)
        exact = P <= 2
        return Result(out, exact, P, None if exact else magnitude)

    def _mpi(self, xs, ctx):
        out = xs[0].copy()
        for x in xs[1:]:
            out += x
        exact = self.P <= 2
        return Result(out, exact, self.P,
                      None if exact else np.sum([np.abs(x, dtype=np.float64) for x in xs], axis=0))

    def _hierarchical(self, xs, ctx):
        """Node sums in rank order, the outer pipeline per share over the
        nodes (ordered by lowest rank; share ``s`` with seed ``seed *
        1_000_003 + s``), every rank ending with every share."""
        n = xs[0].size
        firsts = [min(r for r, h in enumerate(self.nodes) if h == self.nodes[q])
                  for q in range(self.P)]
        members = [[r for r in range(self.P) if firsts[r] == f] for f in sorted(set(firsts))]
        S = max(len(m) for m in members)
        b = chunk_bounds(n, S)
        partial = []
        for m in members:
            acc = xs[m[0]].copy()
            for r in m[1:]:
                acc += xs[r]
            partial.append(acc)
        out = np.empty(n, dtype=np.float32)
        exact, magnitude = True, None      # every share has the same outer pipeline
        for s in range(S):
            lo, hi = int(b[s]), int(b[s + 1])
            pipe = self.shares.get((s, hi - lo))
            if pipe is None:
                pipe = self.shares[(s, hi - lo)] = Pipeline(
                    self.codec, self.outer, len(members), (hi - lo,),
                    seed=self.seed * 1_000_003 + s, step=self.step,
                    error_feedback=self.feedback)
            pipe.step = self.step
            res = pipe([p[lo:hi] for p in partial])
            out[lo:hi] = res.values
            if not res.exact:
                if magnitude is None:
                    magnitude = np.zeros(n)
                magnitude[lo:hi] = res.magnitude
                exact = False
        return Result(out, exact, max(len(members), 1), magnitude)


def sparse_terms(codec: Codec, v: np.ndarray, ectx: EncodeContext) -> np.ndarray:
    """One rank's contribution to a sparse algorithm's sum, dense: the
    codec's ``sparsify`` pairs, or the non-zeros of ``decode(encode(v))``
    (``v`` itself for a lossless codec) for a codec without."""
    n = v.size
    dense = np.zeros(n, dtype=np.float32)
    method = getattr(codec, "sparsify", None)
    if method is not None:
        idx, vals = method(v, ectx)
        dense[np.asarray(idx, dtype=np.int64)] = vals
        return dense
    if codec.lossless:
        dense[:] = v
    else:
        codec.decode(codec.encode(v, ectx), dense)
    dense[dense == 0] = 0       # -0.0 is no pair: the sum holds +0.0 there
    return dense


def simulate(codec: Codec, algorithm, xs: Sequence[np.ndarray], shape: tuple = (),
             seed: int = 0, step: int = 0, **options) -> np.ndarray:
    """The values of one call at ``step`` without residuals: ``Pipeline(...)(xs).values``."""
    return Pipeline(codec, algorithm, len(xs), shape, seed=seed, step=step, **options)(xs).values


# ---------------------------------------------------------------------------
# The statistical band: what a codec's theory allows
# ---------------------------------------------------------------------------
#: below this many elements the band is not applied (the theory is asymptotic)
BAND_MIN_ELEMENTS = 1000
#: relative model error allowed on top of the sampling noise
MODEL_MARGIN = 0.25
#: standard deviations of sampling noise allowed
NOISE_Z = 5.0

_NORMAL = NormalDist()


def _tail(f: float) -> float:
    """The magnitude exceeded by a fraction ``f`` of N(0, 1) entries."""
    return _NORMAL.inv_cdf(1.0 - f / 2.0) if f < 1.0 else 0.0


def _pdf(t: float) -> float:
    return math.exp(-t * t / 2.0) / math.sqrt(2.0 * math.pi)


def _half_normal_mean(fn) -> float:
    """``E[fn(|x|)]`` for x ~ N(0, 1), by the trapezoid rule on [0, 12]."""
    t = np.linspace(0.0, 12.0, 24001)
    w = 2.0 * np.exp(-t * t / 2.0) / math.sqrt(2.0 * math.pi)
    y = fn(t) * w
    return float(np.sum((y[1:] + y[:-1]) * np.diff(t)) / 2.0)


def _tail_cv(t: float, power: int) -> float:
    """Coefficient of variation of ``|x|**power`` over the entries with ``|x| >= t``."""
    inside = lambda f: (lambda a: np.where(a >= t, f(a), 0.0))  # noqa: E731
    p = _half_normal_mean(inside(lambda a: np.ones_like(a)))
    m1 = _half_normal_mean(inside(lambda a: a ** power)) / p
    m2 = _half_normal_mean(inside(lambda a: a ** (2 * power))) / p
    return math.sqrt(max(m2 - m1 * m1, 0.0)) / m1


def _expected_max(m: int) -> float:
    """About ``E[max |x_i|]`` over ``m`` N(0, 1) entries (the 1 - 1/(2m) quantile,
    plus Euler's constant over the density there)."""
    if m <= 1:
        return math.sqrt(2.0 / math.pi)
    t = _tail(1.0 / m)
    return t + 0.5772 / (m * 2.0 * _pdf(t))


@dataclass
class Stage:
    """The theory of one encode-decode of ``n`` i.i.d. N(0, 1) entries.

    ``gain`` = ``<D(x), x> / <x, x>`` and ``mse`` = ``|D(x) - x|^2 / |x|^2``
    as (low, high) ranges the theory allows (before sampling noise);
    ``count``: how many entries carry those statistics (the elements, or the
    entries a sparsifier sends), and ``cv`` the coefficient of variation of
    one entry's share, for the noise; ``unbiased``: ``E[D(x)] = x``;
    ``owner``: the least fraction of its input's energy the owner's
    re-encode in ``twoshot`` keeps, as a function of P (biased codecs; 1:
    the re-encode is lossless)."""

    gain: Tuple[float, float]
    mse: Tuple[float, float]
    count: float
    unbiased: bool
    owner: Optional[Callable[[int], float]] = None
    lossless: bool = False
    why: str = ""
    cv: float = 1.0


def _lossless(why="lossless") -> Stage:
    return Stage((1.0, 1.0), (0.0, 0.0), 1.0, True, lossless=True, why=why)


def _model_halfwidth(codec, n, shape) -> Stage:
    # round to nearest with p mantissa bits: error uniform in +-ulp/2 where ulp
    # = 2**(floor(log2 |x|) - p); E[ulp^2 / 12] / E[x^2] over N(0, 1)
    p = 7 if getattr(codec, "bfloat", False) else 10
    mse = _half_normal_mean(lambda t: np.where(
        t > 0, 4.0 ** (np.floor(np.log2(np.maximum(t, 1e-300))) - p), 0.0) / 12.0)
    return Stage((1.0, 1.0), (mse, mse), n, True,
                 why=f"rounding to {p + 1} significant bits")


def _model_fp8(codec, n, shape) -> Stage:
    # block scale s = M / FP_MAX with M the block's max |x| (about
    # E[max] of B entries); y = |x| / s rounds to nearest with p mantissa
    # bits: error uniform in +-ulp/2, ulp = 2**(max(floor(log2 y), emin) - p)
    # in y units.  Where the scale puts the binade edges varies from block to
    # block: the band spans every shift of them within one octave.
    p, emin, fmax = (2, -14, 57344.0) if codec.e5m2 else (3, -6, 448.0)
    B = max(1, min(codec.block, n))
    s = _expected_max(B) / fmax
    mses = []
    for shift in np.linspace(0.0, 1.0, 9)[:-1]:
        def err(t, shift=shift):
            y = np.maximum(t / s, 1e-300)
            e = np.maximum(np.floor(np.log2(y) + shift), emin) - shift - p
            return np.where(t > 0, (4.0 ** e) * s * s / 12.0, 0.0)
        mses.append(_half_normal_mean(err))
    # each block's max entry (M**2 of its B entries' energy) is exact
    exact = min(0.5, _expected_max(B) ** 2 / B) if B > 1 else 1.0
    return Stage((1.0, 1.0), (min(mses) * (1.0 - exact), max(mses)), n, True,
                 why=f"rounding to {p + 1} significant bits of a per-block scale")


def _model_ebq(codec, n, shape) -> Stage:
    # uniform quantization with step s << 1 on N(0, 1): the error is
    # uniform in +-s/2 and uncorrelated with x, mse s**2 / 12; owners add
    # integer codes and re-encode them exactly (the owner keeps everything)
    mse = codec.step ** 2 / 12.0
    return Stage((1.0, 1.0), (mse, mse), n, True, owner=lambda P: 1.0,
                 why=f"uniform quantization, step {codec.step:.4g}")


def _model_onebit(codec, n, shape) -> Stage:
    # per column, x -> the mean of its sign's entries: the projection keeps
    # (E|x|)^2 = 2/pi of the energy, plus the two fitted means' share of the
    # rest (2 of H degrees of freedom)
    H = min(codec.column_length(shape or (), n), max(n, 1))
    g = 2.0 / math.pi + (1.0 - 2.0 / math.pi) * min(1.0, 2.0 / H)
    # owner: sign means keep (E|a|)^2 / E[a^2] of a symmetric sum: 2/pi
    # Gaussian, 2/3 for the three-point sums of P = 2; half allowed
    return Stage((g, g), (1.0 - g, 1.0 - g), n, False, owner=lambda P: 0.5,
                 why="sign means per column: gain 2/pi")


def _top_fraction(f: float) -> float:
    """Energy share of the fraction ``f`` of largest |x|: f + 2 t phi(t)."""
    t = _tail(f)
    return min(1.0, f + 2.0 * t * _pdf(t))


def _model_topk(codec, n, shape) -> Stage:
    k = max(1, math.ceil(codec.ratio * n))
    if k >= n:
        return _lossless("keeps every entry")
    g = _top_fraction(k / n)
    return Stage((g, g), (1.0 - g, 1.0 - g), k, False, owner=lambda P: 1.0 / P,
                 why=f"the largest {k / n:.3g} of the entries: gain f + 2 t phi(t)",
                 cv=_tail_cv(_tail(k / n), 2))


def _model_dgc(codec, n, shape) -> Stage:
    k = max(1, math.ceil(codec.ratio * n))
    if k >= n:
        return _lossless("keeps every entry")
    lo, hi = _top_fraction(0.8 * k / n), _top_fraction(k / n)
    # the owner keeps the largest of the <= P k entries it receives
    return Stage((lo, hi), (1.0 - hi, 1.0 - lo), 0.8 * k, False, owner=lambda P: 0.5 / P,
                 why="the largest 0.8 k to k entries", cv=_tail_cv(_tail(k / n), 2))


def _model_randk(codec, n, shape) -> Stage:
    k = codec.count(n)
    if k >= n:
        return _lossless("keeps every entry")
    f = k / n
    if codec.unbiased:       # n/k times a random k-subset: E = x, variance (n/k - 1) x^2
        return Stage((1.0, 1.0), (1.0 / f - 1.0, 1.0 / f - 1.0), k, True, owner=lambda P: 1.0,
                     why="k random entries scaled n/k: error sqrt(n/k - 1)")
    return Stage((f, f), (1.0 - f, 1.0 - f), k, False, owner=lambda P: 1.0,
                 why="k random entries: gain k/n", cv=math.sqrt(2.0))


def _model_threshold(codec, n, shape) -> Stage:
    tau = codec.tau if codec.tau is not None else codec.alpha       # RMS of N(0, 1): 1
    q = 2.0 * (1.0 - _NORMAL.cdf(tau))
    cap = min(1.0, codec.max_count(n) / max(n, 1))
    t = tau
    capped = q > cap
    if capped:                  # the cap sends the largest: |x| >= t
        q, t = cap, _tail(cap)
    g = tau * 2.0 * _pdf(t)     # <D, x> = tau E[|x|; sent]
    mse = 1.0 - 2.0 * g + tau * tau * q
    # below the cap the count sent is itself random (Poisson, mean q n): the
    # sum's relative deviation is sqrt(1 + cv^2) over sqrt(count), not cv
    cv = _tail_cv(t, 1)
    if not capped:
        cv = math.sqrt(1.0 + cv * cv)

    def owner(P):
        """The owner thresholds sums of +-tau quanta at alpha RMS of their
        own: a fixed tau keeps about a quarter of them per rank; alpha
        sends them as +-alpha RMS(sum), and a sum of density about P q has
        RMS tau sqrt(P q) -- each quantum shrunk to alpha sqrt(P q) of tau
        (the half of it, for the density's spread)."""
        if codec.tau is not None:
            return 0.25 / P
        return min(0.25 / P, 0.5 * codec.alpha * math.sqrt(min(P * q, 1.0)))

    return Stage((g, g), (mse, mse), q * n, False, owner=owner,
                 why=f"+-tau for |x| >= {t:.3g}", cv=cv)


def _model_adaptive(codec, n, shape) -> Stage:
    f = 1.0 / codec.proportion
    t = _tail(f)
    g = min(1.0, 4.0 * _pdf(t) ** 2 / f)    # the tail's mean, f (2 phi(t) / f)^2
    # sampled thresholds select around the tail: on average a little less;
    # the noise is that of the sampled values above them, per column
    H = max(codec.column_length(n, shape or ()), 1)
    hits = -(-n // H) * min(H, codec.samples) * f
    return Stage((0.8 * g, g), (1.0 - g, 1.0 - 0.8 * g), min(f * n, hits), False,
                 owner=lambda P: 0.25 / P, cv=0.5,
                 why="the tail 1/proportion of each sign sent as its mean")


def _model_qsgd(codec, n, shape) -> Stage:
    d = max(1, min(codec.bucket, n))
    L = codec.levels
    scale = math.sqrt(d) if codec.norm == "l2" else _expected_max(d)
    u = scale / L                # one level
    # stochastic rounding to multiples of u: variance u^2 frac (1 - frac)
    var = _half_normal_mean(lambda t: u * u * (t / u % 1.0) * (1.0 - t / u % 1.0))
    return Stage((1.0, 1.0), (var, var), n, True,
                 why=f"stochastic rounding to {L} levels of the bucket's {codec.norm} norm")


def _model_terngrad(codec, n, shape) -> Stage:
    s = _expected_max(n) if codec.clip is None else min(_expected_max(n), codec.clip)
    m1 = _half_normal_mean(lambda t: np.minimum(t, s))
    m2 = _half_normal_mean(lambda t: np.minimum(t, s) ** 2)
    over = _half_normal_mean(lambda t: np.maximum(t - s, 0.0) ** 2)
    gain = _half_normal_mean(lambda t: np.minimum(t, s) * t)
    mse = s * m1 - m2 + over     # ternary variance s|c| - c^2, plus the clipped part
    return Stage((gain, gain), (mse, mse), n, True,
                 why=f"ternary codes of scale {s:.3g} (clipped), unbiased below it")


#: the theory of each built-in codec, by name; a codec may instead define
#: ``error_model(n, shape) -> Stage``
MODELS: Dict[str, Callable[[Codec, int, tuple], Stage]] = {
    "fp16": _model_halfwidth, "bf16": _model_halfwidth, "fp8": _model_fp8, "ebq": _model_ebq,
    "onebit": _model_onebit,
    "topk": _model_topk, "dgc": _model_dgc, "randk": _model_randk,
    "threshold": _model_threshold, "adaptive": _model_adaptive, "qsgd": _model_qsgd,
    "terngrad": _model_terngrad,
}


def stage_model(codec: Codec, n: int, shape: tuple = ()) -> Optional[Stage]:
    """The theory of ``codec`` on ``n`` N(0, 1) entries of a tensor of
    ``shape``: its own ``error_model``, else that of the nearest class in its
    ancestry that :data:`MODELS` knows; lossless codecs are exact; a rotated
    codec has its inner codec's (a rotated N(0, 1) vector is N(0, 1)); None
    for a lossy codec with no theory."""
    if isinstance(codec, RotatedCodec):
        return stage_model(codec.inner, n, shape)
    own = getattr(codec, "error_model", None)
    if own is not None:
        return own(n, shape)
    if codec.lossless:
        return _lossless()
    for cls in type(codec).__mro__:
        name = cls.__dict__.get("name")
        if name in MODELS:
            return MODELS[name](codec, n, shape)
    return None


@dataclass
class Band:
    """What the theory allows of a result ``r`` against the exact sum ``s``:
    ``gain = <r, s> / <s, s>`` and ``rel = |r - s| / |s|``, each a closed
    range."""

    gain: Tuple[float, float]
    rel: Tuple[float, float]
    why: str

    def __str__(self):
        return (f"gain [{self.gain[0]:.3g}, {self.gain[1]:.3g}], "
                f"rel_err [{self.rel[0]:.3g}, {self.rel[1]:.3g}] ({self.why})")


def error_band(codec: Codec, algorithm, nranks: int, n: int, shape: tuple = (), *,
               nodes: Optional[Sequence] = None, outer: str = "twoshot",
               choice: Optional[str] = None) -> Optional[Band]:
    """The range of ``gain`` and ``rel_err`` the codec's theory allows for one
    call (no residual) of ``algorithm`` on ``nranks`` ranks with i.i.d.
    N(0, 1) inputs of ``n`` elements (see the module docstring).  None where
    no theory applies: a lossy codec without a model, fewer than
    :data:`BAND_MIN_ELEMENTS` elements, or less than one entry a
    sparsifier is expected to send.

    Composition: every rank's error is independent, so one encode per rank
    (``allgather``, ``summable``, the sparse algorithms, ``twoshot`` at
    P = 1) keeps the codec's ``gain`` and ``mse``.  ``twoshot``'s owner
    re-encodes the sum of the decoded chunks: for an unbiased codec the gain
    stays 1 and the owner adds at most the codec's relative error on a vector
    of ``1 + mse`` times the energy; a biased codec's owner keeps at least
    the model's ``owner(P)`` of what it received.  ``hierarchical`` is its
    outer algorithm over the nodes on shares of the vector.  The ranges are
    then widened by :data:`MODEL_MARGIN` and :data:`NOISE_Z` standard
    deviations of sampling noise (about ``1 / sqrt(count)``)."""
    P = int(nranks)
    name = pipeline_of(algorithm)
    if name == "auto":
        name = "mpi" if choice == "dense" else choice
    if name == "hierarchical":
        if nodes is None:
            return None
        groups = len(set(nodes))
        S = max(list(nodes).count(h) for h in set(nodes))
        return error_band(codec, outer, groups, n // max(S, 1), (n // max(S, 1),))
    lossless_bound = 1e-5 * max(1, P)
    if name == "mpi" or codec.lossless:
        return Band((1.0 - lossless_bound, 1.0 + lossless_bound), (0.0, lossless_bound),
                    "lossless: float32 rounding of the sums only")
    stage = stage_model(codec, n, shape)
    if stage is not None and stage.lossless:
        return Band((1.0 - lossless_bound, 1.0 + lossless_bound), (0.0, lossless_bound),
                    stage.why)
    if stage is None or n < BAND_MIN_ELEMENTS or stage.count < 1.0:
        return None             # (less than one entry expected: no statistics to hold)
    two = name == "twoshot" and P > 1 and not (stage.owner is not None and stage.owner(P) >= 1.0)
    r_lo, r_hi = math.sqrt(stage.mse[0]), math.sqrt(stage.mse[1])
    g_lo, g_hi = stage.gain
    count = max(stage.count, 1.0)
    if stage.unbiased:
        if two:
            r_hi = math.sqrt(stage.mse[1] * (2.0 + stage.mse[1]))
        # <error, s> / <s, s>: zero mean, deviation at most sqrt(3) rel / sqrt(n)
        dev = MODEL_MARGIN * (1.0 - g_lo) + NOISE_Z * math.sqrt(3.0) * r_hi / math.sqrt(n)
        gain = (g_lo - dev, g_hi + dev)
        # rel^2 is a mean over the entries that carry the error
        widen = MODEL_MARGIN + NOISE_Z / math.sqrt(2.0 * count)
    else:
        noise = NOISE_Z * stage.cv / math.sqrt(count)    # the entries kept
        if two:
            g_lo *= stage.owner(P)
            r_hi = 1.0
        # NOISE_Z deviations either side: none below zero once they reach it
        gain = (g_lo * max(1.0 - noise, 0.0) / (1.0 + MODEL_MARGIN),
                g_hi * (1.0 + MODEL_MARGIN + noise))
        # rel^2 is about 1 - gain: its noise is the gain's, scaled down
        widen = MODEL_MARGIN + noise * g_hi / max(2.0 * (1.0 - g_hi), 1e-3)
    rel = (r_lo / (1.0 + widen), r_hi * (1.0 + widen) + lossless_bound)
    return Band(gain, rel, stage.why)


def band_statistics(result, exact) -> Tuple[float, float]:
    """``(gain, rel_err)`` of a result against the exact float64 sum."""
    r = np.asarray(result, dtype=np.float64).reshape(-1)
    s = np.asarray(exact, dtype=np.float64).reshape(-1)
    ss = float(np.dot(s, s))
    if ss == 0.0:
        return 1.0, float(np.linalg.norm(r))
    return float(np.dot(r, s)) / ss, float(np.linalg.norm(r - s)) / math.sqrt(ss)


def check_band(result, exact, band: Optional[Band]) -> Optional[str]:
    """None when the result's gain and relative error lie in ``band`` (or
    there is no band), else what is off."""
    if band is None:
        return None
    gain, rel = band_statistics(result, exact)
    off = []
    if not band.gain[0] <= gain <= band.gain[1]:
        off.append(f"gain {gain:.4g}")
    if not band.rel[0] <= rel <= band.rel[1]:
        off.append(f"rel_err {rel:.4g}")
    if not off:
        return None
    return f"{' and '.join(off)} outside the codec's band: {band}"
