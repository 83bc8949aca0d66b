"""The slot kernels of ``threshold`` (hpccomm.kernels.threshold_slots)
against the codec's general steps, without MPI: the same packet bytes,
residuals and results on random inputs of awkward sizes -- a fixed ``tau``
and ``alpha``, more quanta than the capacity (ties at the cut), all zeros;
NaN/Inf and broken packets reported before anything is written."""
import numpy as np
import pytest

import hpccomm

from .slot_checks import check_encode, check_owner, check_refused, slot_for

SIZES = [1, 2, 7, 63, 512, 1001, 4095]
#: alpha's default; a fixed tau that many integers reach; a capacity far
#: below what qualifies (the cap largest go, ties to the lower index)
OPTIONS = [{}, {"tau": 1.0}, {"tau": 1.0, "max_ratio": 0.05}, {"alpha": 0.5, "max_ratio": 0.1}]


def vector(rng, n, kind):
    if kind == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "ties":
        return rng.integers(-3, 4, n).astype(np.float32)
    return np.zeros(n, np.float32)


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["normal", "ties", "zeros"])
@pytest.mark.parametrize("feedback", [True, False])
def test_encode_slot_is_encode_with_feedback(options, n, kind, feedback):
    codec = hpccomm.get_codec("threshold", **options)
    rng = np.random.default_rng(n)
    x = vector(rng, n, kind)
    e = vector(rng, n, "normal") * np.float32(0.5) if feedback else None
    check_encode(codec, x, e)


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["normal", "ties"])
@pytest.mark.parametrize("memory", ["residual", "none", "fresh"])
@pytest.mark.parametrize("P", [1, 3])
def test_owner_slot_is_owner_step(options, n, kind, memory, P):
    codec = hpccomm.get_codec("threshold", **options)
    rng = np.random.default_rng(n + 7 * P)
    inputs = [vector(rng, n, kind) for _ in range(P)]
    check_owner(codec, inputs, vector(rng, n, "normal") if memory == "residual" else None,
                memory)


def test_nonfinite_values_are_counted_and_nothing_is_sent():
    codec = hpccomm.get_codec("threshold")
    n = 101
    x = np.ones(n, np.float32)
    x[[3, 50]] = [np.nan, np.inf]
    slot, views = slot_for(codec, n)
    before = slot.copy()
    assert codec.encode_slot(views, x, None, np.empty(n, np.float32)) == 2
    assert np.array_equal(slot, before)
    codec = hpccomm.get_codec("threshold", tau=3e38)         # two quanta add up to inf
    slot, views = slot_for(codec, n)
    before = slot.copy()
    big = codec.encode(np.full(n, 3e38, np.float32))
    rows = np.zeros((2, slot.size), np.uint8)
    rows[:, :big.size] = big
    status = codec.owner_slot(codec.row_views(rows), codec.slot_count(n), None, None,
                              np.empty(n, np.float32), views)
    assert status > 0 and np.array_equal(slot, before)


@pytest.mark.parametrize("breakage", ["count", "tau", "negative tau", "padding", "order",
                                      "range"])
def test_broken_packets_are_refused_before_anything_is_written(breakage):
    codec = hpccomm.get_codec("threshold", tau=0.5)
    n = 100
    cap = codec.slot_count(n)
    packet = codec.encode(np.random.default_rng(0).standard_normal(n).astype(np.float32))
    slot = np.zeros(codec.capacity_for(n, (n,)), np.uint8)
    slot[:packet.size] = packet
    words, floats = slot.view(np.uint32), slot.view(np.float32)
    m = int(words[1])
    assert m >= 2
    if breakage == "count":
        words[1] = cap + 1
    elif breakage == "tau":
        floats[4] = np.nan
    elif breakage == "negative tau":
        floats[4] = -0.5
    elif breakage == "padding":
        words[5] = 1
    elif breakage == "order":
        words[6], words[7] = words[7], words[6]
    else:
        words[6 + m - 1] = (n << 1) | 1
    check_refused(codec, slot, n, cap)


def test_slot_entries_and_subclasses():
    """One block's sum of squares; a subclass that changes a step gets none."""
    from hpccomm.codecs.threshold import Threshold
    from hpccomm.kernels.sparsify import BLOCK

    class Scaled(Threshold):
        def _threshold(self, x, ctx, ss=None):
            return np.float32(2 * super()._threshold(x, ctx, ss))

    assert Threshold().slot_count(BLOCK) == BLOCK // 4
    assert Threshold().slot_count(BLOCK + 1) is None
    assert Scaled().slot_count(100) is None
