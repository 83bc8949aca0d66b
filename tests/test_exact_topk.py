"""The slot kernels of ``topk`` and ``dgc`` (hpccomm.kernels.exact_topk)
against the codecs' general steps, without MPI: the same packet bytes,
residuals and results on random inputs of awkward sizes, with ties, zeros
and signed zeros; NaN/Inf and broken packets reported before anything is
written."""
import numpy as np
import pytest

import hpccomm
from hpccomm.codecs.base import HEADER_SIZE

from .slot_checks import check_encode, check_owner, check_refused, slot_for

SIZES = [1, 2, 7, 63, 512, 1001, 4095]
CODECS = [("topk", {}), ("topk", {"ratio": 0.3}), ("topk", {"ratio": 1.0}),
          ("topk", {"exact": True, "ratio": 0.05}), ("dgc", {}), ("dgc", {"ratio": 0.02})]


def codec_of(name, options):
    return hpccomm.get_codec(name, **options)


def vector(rng, n, kind):
    """``kind``: normal values; ``ties``: few distinct magnitudes (the cut
    falls inside a run of equal ones); ``zeros``: mostly (signed) zeros."""
    if kind == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "ties":
        return rng.integers(-3, 4, n).astype(np.float32)
    x = np.zeros(n, np.float32)
    x[rng.random(n) < 0.5] = -0.0
    few = rng.random(n) < 0.02
    x[few] = rng.standard_normal(int(few.sum())).astype(np.float32)
    return x


def cases():
    for name, options in CODECS:
        for n in SIZES:
            codec = codec_of(name, options)
            if codec.exact_count(n) is not None:
                yield pytest.param(name, options, n, id=f"{name}-{options}-{n}")


@pytest.mark.parametrize("name,options,n", list(cases()))
@pytest.mark.parametrize("kind", ["normal", "ties", "zeros"])
@pytest.mark.parametrize("feedback", [True, False])
def test_encode_slot_is_encode_with_feedback(name, options, n, kind, feedback):
    codec = codec_of(name, options)
    rng = np.random.default_rng(n)
    x = vector(rng, n, kind)
    e = vector(rng, n, kind) * np.float32(0.5) if feedback else None
    check_encode(codec, x, e)


@pytest.mark.parametrize("name,options,n", list(cases()))
@pytest.mark.parametrize("kind", ["normal", "ties", "zeros"])
@pytest.mark.parametrize("memory", ["residual", "none", "fresh"])
@pytest.mark.parametrize("P", [1, 3])
def test_owner_slot_is_owner_step(name, options, n, kind, memory, P):
    """Received slots of P ranks (packets shorter than their slots, stale
    bytes after them) against ``owner_step`` on the packets: the owner's
    packet, its slice of ``out`` and its residual."""
    codec = codec_of(name, options)
    rng = np.random.default_rng(n + 7 * P)
    inputs = [vector(rng, n, kind) for _ in range(P)]
    check_owner(codec, inputs, vector(rng, n, kind) if memory == "residual" else None, memory)


@pytest.mark.parametrize("name", ["topk", "dgc"])
def test_nonfinite_values_are_counted_and_nothing_is_sent(name):
    codec = codec_of(name, {"ratio": 0.1, **({"sample_ratio": 1.0} if name == "dgc" else {})})
    n = 101
    assert codec.exact_count(n) is not None
    x = np.ones(n, np.float32)
    x[[3, 50]] = [np.nan, -np.inf]
    slot, views = slot_for(codec, n)
    before = slot.copy()
    assert codec.encode_slot(views, x, None, np.empty(n, np.float32)) == 2
    assert np.array_equal(slot, before)
    # the owner: a sum that overflows to inf
    big = codec.encode(np.full(n, 3e38, np.float32))
    rows = np.zeros((2, slot.size), np.uint8)
    rows[:, :big.size] = big
    out = np.empty(n, np.float32)
    assert codec.owner_slot(codec.row_views(rows), codec.exact_count(n), None, None, out,
                            views) == codec.exact_count(n)
    assert np.array_equal(slot, before)


@pytest.mark.parametrize("breakage", ["count", "negative count", "order", "range"])
def test_broken_packets_are_refused_before_anything_is_written(breakage):
    codec = codec_of("topk", {"ratio": 0.1})
    n = 100
    k = codec.exact_count(n)
    packet = codec.encode(np.random.default_rng(0).standard_normal(n).astype(np.float32))
    slot = np.zeros(codec.capacity_for(n, (n,)), np.uint8)
    slot[:packet.size] = packet
    words = slot.view(np.int32)
    if breakage == "count":
        words[1] = k + 1
    elif breakage == "negative count":
        words[1] = -1
    elif breakage == "order":
        words[4], words[5] = words[5], words[4]
    else:
        words[4 + k - 1] = n
    check_refused(codec, slot, n, k)


def test_a_slot_that_announces_more_than_it_holds_is_a_packet_error():
    codec = codec_of("topk", {"ratio": 0.1})
    k = codec.exact_count(100)
    slot = np.zeros(codec.capacity_for(100, (100,)), np.uint8)
    codec.bind_header(slot, 100, extra=k)
    assert codec.packet_in_slot(slot, 100).size == slot.size == HEADER_SIZE + 8 * k
    with pytest.raises(hpccomm.PacketError, match="in a slot of"):
        codec.packet_in_slot(slot[:-8], 100)
    codec.bind_header(slot, 100, extra=k + 1)
    with pytest.raises(hpccomm.PacketError, match="announces"):
        codec.packet_in_slot(slot, 100)


def test_exact_count_where_the_selection_is_exact():
    """``topk`` samples above ``ceil(256 / ratio)`` elements; ``dgc`` above
    ``2 / ratio`` or when its sample's count falls short of ``k``."""
    topk = codec_of("topk", {"ratio": 0.01})
    assert topk.exact_count(25_600) == 256 and topk.exact_count(25_601) is None
    dgc = codec_of("dgc", {"ratio": 0.001})
    assert dgc.exact_count(2000) == 2 and dgc.exact_count(2001) is None
    assert codec_of("dgc", {"ratio": 0.07, "sample_ratio": 1.0}).exact_count(100) == 7


def test_a_subclass_that_changes_a_step_runs_its_own_steps():
    """The slot kernels stand for topk's own steps: a subclass that decodes,
    selects or finishes otherwise gets none (test_bench.py's zero decoder)."""
    from hpccomm.codecs.topk import TopK

    class ZeroTopK(TopK):
        def _decode_into(self, packet, header, out, add):
            if not add:
                out[:] = 0

    class WiderTopK(TopK):
        def max_count(self, n):
            return min(n, 2 * super().max_count(n))

    assert TopK(0.1).slot_count(100) == 10
    assert ZeroTopK(0.1).slot_count(100) is None
    assert WiderTopK(0.1).slot_count(100) is None
