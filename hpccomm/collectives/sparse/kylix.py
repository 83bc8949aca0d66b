"""``kylix``: a nested, heterogeneous-degree butterfly (Zhao & Canny, ICPP 2014).

Topology.  ``P = k_1 k_2 ... k_D`` (the ``degrees``).  At layer ``l``, with
``c_l = k_1 ... k_{l-1}``, rank ``r`` has position ``p = (r // c_l) mod k_l``
in the group ``{r - p c_l + j c_l : j = 0 .. k_l - 1}`` (ranks that differ
only in mixed-radix digit ``l``).  Every rank starts with the index range
``[0, n)``; at each layer its current range ``[L, R)`` is cut into ``k_l``
parts at ``L + (R - L) j // k_l`` and it keeps part ``p`` (nested ranges), so
after the last layer the ``P`` ranks own disjoint ranges.  Within a group,
messages follow the pairwise schedule: step ``s = 1 .. k_l - 1`` sends to
position ``(p + s) mod k_l`` and receives from ``(p - s) mod k_l``
(``MPI_Sendrecv``), which keeps every link busy without deadlock.

Configuration (indices only; cached).  Down the layers, each rank cuts its
sorted index set at the part boundaries, sends part ``j`` to position ``j``
(int64 byte count, then the indices) and merges the ``k_l`` parts it receives
for its own part into their sorted union, recording for each part a map
(positions in the union); the union is the next layer's set.  Back up the
layers, each rank sends its set to the other members of its group and
concatenates the ``k_l`` sets in position order (the ranges are ordered), so
every rank ends with the sorted union of all indices and the sizes of every
piece.

Reduce (values only).  Down: per layer, send the float32 values of part
``j`` to position ``j`` (sizes known from the configuration: no counts),
scatter-add the ``k_l`` received parts **in position order** into a zeroed
array over the union through the maps.  Up: send the values of the current
set to the group, concatenate in position order.  On the wire: 4 bytes per
non-zero per layer after configuration; configuration costs ``b`` bytes
(int32/int64) per index per layer plus an int64 count per message.

Bit identity: every index is summed by exactly one rank per layer and the
final sums by the owner of the index's final range; the up phase only
copies, so every rank receives the owners' bits.

Caching.  The configuration depends only on the index sets.  It is kept in
``state.cache["kylix"]`` keyed by a hash of this rank's indices (with ``n``
and the options).  Whether to reuse it must be decided alike on every rank:
one ``MPI_Allreduce`` (SUM of int64 ``[index set changed here, nnz]``) tells
every rank whether *any* index set changed; the summed ``nnz`` also feeds the
automatic degree choice.

Degrees.  ``degrees=(k_1, ..., k_D)`` with product ``P``, or automatic: over
the factorizations of ``P`` into non-increasing degrees (larger degrees
first, as the paper argues: data are sparsest at the top, so messages there
are smallest), pick the one minimising the modelled time per reduce,
``sum_l [2 (k_l - 1) ALPHA + BETA (down_l + up_l)]``, with
``down_l = 4 (k_l - 1) / k_l * (n / c_l) (1 - (1 - d)**c_l)`` (the expected
union after merging ``c_l`` sets of density ``d``), ``up_l = 4 (k_l - 1)
(n / c_{l+1}) (1 - (1 - d)**P)``, ``d`` = mean input density, ``ALPHA`` =
20 us per message and ``BETA`` = 1 / (1.25 GB/s) (a 10 Gbit/s commodity
network).  Sparse data favour one wide layer (each layer re-sends what did not
merge), dense data a deep binary-like butterfly (fewer bytes per message
count).  Any ``P`` factors this way; a prime ``P`` gets a single layer of
degree ``P`` (a direct all-to-all).

Hashing.  With ``hash_indices=True`` indices are routed by the bijection
``h(i) = (a i) mod n``, ``a`` the odd number next to ``0.618 n`` coprime to
``n`` (a multiplicative "golden ratio" hash): a contiguous hot range maps to
points spread almost evenly over ``[0, n)`` (three-gap theorem), so hot
ranges no longer overload one subtree.  The permutation is used for routing
only; results are returned by original index.
"""
from __future__ import annotations

import hashlib
import math
from typing import List, Optional, Tuple

import numpy as np

from ...errors import PacketError
from ...kernels import merge as K
from ..base import register_algorithm
from .base import SparseAlgorithm, check_indices, index_dtype

ALPHA = 20e-6          #: modelled seconds per message
BETA = 1.0 / 1.25e9    #: modelled seconds per byte
CACHE_KEY = "kylix"


def _indices(payload: np.ndarray, idt: np.dtype) -> np.ndarray:
    """The indices in a message from another rank (whole ``idt`` items, else
    a PacketError); the caller checks their order and range."""
    if payload.size % idt.itemsize:
        raise PacketError(f"kylix: an index message of {payload.size} bytes is not whole "
                          f"{idt.itemsize}-byte indices")
    return payload.view(idt)


def _divisors(P: int) -> List[int]:
    small = [d for d in range(2, math.isqrt(P) + 1) if P % d == 0]
    return sorted(set(small + [P // d for d in small] + ([P] if P > 1 else [])))


def factorizations(P: int) -> List[Tuple[int, ...]]:
    """All ways to write ``P`` as a product of non-increasing factors >= 2
    (``[()]`` for ``P = 1``), larger leading factors first."""
    divisors = _divisors(P)

    def rec(m, largest):
        if m == 1:
            return [()]
        out = []
        for k in reversed(divisors):
            if k <= largest and k <= m and m % k == 0:
                out.extend((k,) + rest for rest in rec(m // k, k))
        return out

    return rec(P, P)


def modelled_time(degrees, n: int, density: float) -> float:
    """The degree-selection cost model of the module docstring."""
    P = math.prod(degrees)
    keep = 1.0 - density
    full = 1.0 - keep ** P
    cost, c = 0.0, 1
    for k in degrees:
        down = 4.0 * (k - 1) / k * (n / c) * (1.0 - keep ** c)
        up = 4.0 * (k - 1) * (n / (c * k)) * full
        cost += 2 * (k - 1) * ALPHA + BETA * (down + up)
        c *= k
    return cost


def choose_degrees(P: int, n: int, nnz_total: int) -> Tuple[int, ...]:
    """The factorization of ``P`` with the smallest :func:`modelled_time`
    (the first, i.e. the one with larger leading degrees, on ties)."""
    density = min(1.0, nnz_total / (P * n)) if n else 0.0
    return min(factorizations(P), key=lambda f: modelled_time(f, n, density))


def hash_multiplier(n: int) -> int:
    """``a`` of ``h(i) = a i mod n``: odd, near ``0.618 n``, coprime to ``n``."""
    if n <= 2:
        return 1
    a = int(n * 0.6180339887498949) | 1
    while math.gcd(a, n) != 1:
        a += 2
    return a % n


def union_with_maps(pieces: List[np.ndarray]):
    """Sorted union of sorted index arrays, and for each piece the positions
    of its entries in the union.  A stable sort of the concatenation (timsort:
    ``O(m log k)`` for ``k`` sorted runs), then run-length ranks."""
    keys = np.concatenate(pieces)
    order = np.argsort(keys, kind="stable")
    ranked = keys[order]
    first = np.ones(ranked.size, dtype=bool)
    np.not_equal(ranked[1:], ranked[:-1], out=first[1:])
    position = np.empty(ranked.size, dtype=np.int64)
    position[order] = np.cumsum(first) - 1
    ends = np.cumsum([p.size for p in pieces])
    return ranked[first], np.split(position, ends[:-1])


class _Layer:
    __slots__ = ("members", "pos", "cuts", "maps", "size", "up_sizes")

    def __init__(self, members, pos, cuts, maps, size):
        self.members, self.pos, self.cuts, self.maps, self.size = members, pos, cuts, maps, size
        self.up_sizes: List[int] = []


class _Config:
    """Routing tables of one index pattern (see the module docstring)."""

    __slots__ = ("key", "degrees", "order", "layers", "union", "union_order")

    def __init__(self, key, degrees, order, layers, union, union_order):
        self.key = key
        self.degrees = degrees
        #: this rank's pairs in routing order (None: already in order)
        self.order: Optional[np.ndarray] = order
        self.layers: List[_Layer] = layers
        #: original indices of the global union, in routing order
        self.union: np.ndarray = union
        #: positions that sort ``union`` (None: already sorted)
        self.union_order: Optional[np.ndarray] = union_order


@register_algorithm
class Kylix(SparseAlgorithm):
    name = "kylix"

    def __init__(self, comm, codec, degrees=None, hash_indices=False):
        super().__init__(comm, codec)
        if degrees is not None:
            try:
                degrees = tuple(int(k) for k in degrees)
            except TypeError:
                raise TypeError(f"kylix: degrees must be a sequence of integers, not "
                                f"{degrees!r}") from None
            if any(k < 2 for k in degrees) or math.prod(degrees) != self.size:
                raise ValueError(f"kylix: degrees {degrees} must be integers >= 2 whose product "
                                 f"is the number of ranks, {self.size}")
        self.degrees = degrees
        self.hash_indices = bool(hash_indices)

    def params(self):
        return {"degrees": "auto" if self.degrees is None else "x".join(map(str, self.degrees)),
                "hash": self.hash_indices}

    # ------------------------------------------------------------ plumbing
    def _group(self, c: int, k: int):
        pos = (self.rank // c) % k
        base = self.rank - pos * c
        return [base + j * c for j in range(k)], pos

    @staticmethod
    def _exchange_parts(net, parts, members, pos, recv_sizes=None):
        """Pairwise exchange inside a group: ``parts[j]`` (uint8) goes to
        position ``j``; returns what each position sent (own part kept)."""
        k = len(members)
        got = [None] * k
        got[pos] = parts[pos]
        for s in range(1, k):
            dst, src = (pos + s) % k, (pos - s) % k
            got[src] = net.sendrecv(parts[dst], members[dst], members[src],
                                    None if recv_sizes is None else recv_sizes[src])
        return got

    # ------------------------------------------------------------ config
    def _config_key(self, idx: np.ndarray, n: int) -> bytes:
        """A hash of this rank's index set, ``n`` and the options."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{n} {idx.dtype} {self.describe()}".encode())
        h.update(idx.view(np.uint8).data)
        return h.digest()

    def configure(self, idx: np.ndarray, n: int, nnz_total: int, key: bytes, net) -> _Config:
        """Build the routing tables for this rank's (sorted) index set ``idx``."""
        P, call = self.size, net.call
        idt = index_dtype(n)
        degrees = self.degrees if self.degrees is not None else choose_degrees(P, n, nnz_total)
        with call.time("encode"):
            if self.hash_indices and n > 2:
                keys = K.affine_map(idx, hash_multiplier(n), 0, n)
                order = np.argsort(keys, kind="stable")
                current = keys[order].astype(idt)
            else:
                order = None
                current = idx
        lo, hi, c = 0, n, 1
        layers = []
        for k in degrees:
            members, pos = self._group(c, k)
            bounds = [lo + (hi - lo) * j // k for j in range(k + 1)]
            cuts = np.searchsorted(current, np.asarray(bounds, dtype=np.int64))
            parts = [current[cuts[j]:cuts[j + 1]].view(np.uint8) for j in range(k)]
            got = [_indices(g, idt) for g in self._exchange_parts(net, parts, members, pos)]
            for g in got:
                check_indices(g, bounds[pos], bounds[pos + 1], "kylix: index message")
            with call.time("encode"):
                union, maps = union_with_maps(got)
            layers.append(_Layer(members, pos, cuts, maps, union.size))
            current = union
            lo, hi, c = bounds[pos], bounds[pos + 1], c * k
        for layer in reversed(layers):
            k = len(layer.members)
            got = self._exchange_parts(net, [current.view(np.uint8)] * k, layer.members, layer.pos)
            pieces = [_indices(g, idt) for g in got]     # checked once, joined, below
            layer.up_sizes = [p.size for p in pieces]
            current = np.concatenate(pieces)
        check_indices(current, 0, n, "kylix: the gathered index set")
        with call.time("encode"):
            union = current.astype(np.int64)
            union_order = None
            if order is not None:
                union = K.affine_map(union, pow(hash_multiplier(n), -1, n), 0, n)
                union_order = np.argsort(union)
        return _Config(key, degrees, order, layers, union, union_order)

    # ------------------------------------------------------------ reduce
    def reduce_sparse(self, idx, vals, n, state, net, out=None):
        P, call = self.size, net.call
        key = self._config_key(idx, n)
        cached = state.cache.get(CACHE_KEY)
        changed = 0 if isinstance(cached, _Config) and cached.key == key else 1
        flags = np.array([changed, idx.size], dtype=np.int64)
        if P > 1:
            net.allreduce(flags)
        if flags[0] == 0:
            config = cached
        else:
            config = self.configure(idx, n, int(flags[1]), key, net)
            state.cache[CACHE_KEY] = config
        call.extra["config_cached"] = bool(flags[0] == 0)
        call.extra["degrees"] = config.degrees
        v = vals[config.order] if config.order is not None else vals
        for layer in config.layers:
            k = len(layer.members)
            parts = [v[layer.cuts[j]:layer.cuts[j + 1]].view(np.uint8) for j in range(k)]
            got = self._exchange_parts(net, parts, layer.members, layer.pos,
                                       [4 * m.size for m in layer.maps])
            with call.time("decode"):
                acc = np.zeros(layer.size, dtype=np.float32)
                for j in range(k):  # position order: one fixed sum per index
                    K.scatter_add(acc, layer.maps[j], got[j].view(np.float32), 0)
            v = acc
        for layer in reversed(config.layers):
            k = len(layer.members)
            got = self._exchange_parts(net, [v.view(np.uint8)] * k, layer.members, layer.pos,
                                       [4 * s for s in layer.up_sizes])
            v = np.concatenate([g.view(np.float32) for g in got])
        with call.time("decode"):
            if out is not None:
                out[...] = 0
                K.scatter_set(out, config.union, v, 0)
                return None
            union = config.union
            if config.union_order is not None:
                union, v = union[config.union_order], v[config.union_order]
            return K.drop_zeros(union.astype(index_dtype(n)), v)
