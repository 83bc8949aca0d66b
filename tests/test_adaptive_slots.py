"""The slot kernels of ``adaptive`` (hpccomm.kernels.adaptive_slots) against
the codec's general steps, without MPI: the same packet bytes, residuals and
results, for vectors and for matrices (columns of the last dimension), with
the call's random stream and a chunk's offset, full columns, ties and
ragged last columns; NaN/Inf and broken packets reported before anything is
written."""
import numpy as np
import pytest

import hpccomm
from hpccomm.codecs.base import EncodeContext
from hpccomm.kernels.adaptive_slots import BAD_PACKET

from .slot_checks import check_encode, check_owner, check_refused, slot_for

#: (elements, the tensor's shape) of a chunk: a vector's one ragged column,
#: whole columns of a matrix, and columns of a chunk that starts inside a
#: larger tensor
CASES = [(1, (1,)), (7, (7,)), (1001, (1001,)), (4095, (4095,)), (12 * 33, (12, 33)),
         (40 * 7 + 5, (400, 7)), (3 * 128, (3, 128))]
OPTIONS = [{}, {"proportion": 8, "excess": 1}, {"proportion": 4, "col_len": 50}]


def vector(rng, n, kind):
    if kind == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "ties":
        return rng.integers(-3, 4, n).astype(np.float32)
    return (rng.standard_cauchy(n) * 10).astype(np.float32)


def context(shape, offset=0):
    return EncodeContext(seed=5, rank=1, step=3, offset=offset, shape=shape, feedback=True)


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("n,shape", CASES)
@pytest.mark.parametrize("kind", ["normal", "ties", "heavy"])
@pytest.mark.parametrize("feedback", [True, False])
def test_encode_slot_is_encode_with_feedback(options, n, shape, kind, feedback):
    codec = hpccomm.get_codec("adaptive", **options)
    rng = np.random.default_rng(n)
    x = vector(rng, n, kind)
    e = vector(rng, n, "normal") * np.float32(0.5) if feedback else None
    assert codec.slot_count(n, shape) is not None
    check_encode(codec, x, e, context(shape, offset=shape[-1] * 3))


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("n,shape", CASES)
@pytest.mark.parametrize("memory", ["residual", "none", "fresh"])
@pytest.mark.parametrize("P", [1, 3])
def test_owner_slot_is_owner_step(options, n, shape, memory, P):
    codec = hpccomm.get_codec("adaptive", **options)
    rng = np.random.default_rng(n + 7 * P)
    inputs = [vector(rng, n, "normal" if j % 2 else "heavy") for j in range(P)]
    check_owner(codec, inputs, vector(rng, n, "normal") if memory == "residual" else None,
                memory, context(shape, offset=n))


def test_an_empty_chunk():
    """A chunk without elements (a vector shorter than a column is one
    rank's chunk): its fields alone, and a non-empty one refused."""
    codec = hpccomm.get_codec("adaptive")
    slot, views = slot_for(codec, 0, (500,))
    assert codec.slot_count(0, (500,)) == 0
    assert codec.encode_slot(views, np.empty(0, np.float32), None, np.empty(0, np.float32),
                             codec.draw(context((500,)))) == 0
    assert codec.packet_in_slot(slot, 0).tobytes() == codec.encode(
        np.empty(0, np.float32)).tobytes()
    rows = np.stack([slot, slot])
    out = np.empty(0, np.float32)
    assert codec.owner_slot(codec.row_views(rows, 0, (500,)), 0, None, None, out, views,
                            codec.draw(context((500,)))) == 0
    assert codec.decode_slot(codec.row_views(slot, 0, (500,)), 0, out)
    rows.view(np.uint32)[1, 4] = 3
    assert codec.owner_slot(codec.row_views(rows, 0, (500,)), 0, None, None, out, views,
                            codec.draw(context((500,)))) == BAD_PACKET


def test_nonfinite_values_are_counted_and_nothing_is_sent():
    codec = hpccomm.get_codec("adaptive")
    n, shape = 300, (300,)
    x = np.ones(n, np.float32)
    x[[3, 250]] = [np.nan, np.inf]
    slot, views = slot_for(codec, n, shape)
    before = slot.copy()
    assert codec.encode_slot(views, x, None, np.empty(n, np.float32),
                             codec.draw(context(shape))) == 2
    assert np.array_equal(slot, before)


@pytest.mark.parametrize("breakage", ["count", "total", "H", "column count", "order", "range"])
def test_broken_packets_are_refused_before_anything_is_written(breakage):
    codec = hpccomm.get_codec("adaptive", proportion=4)
    n, shape = 12 * 33, (12, 33)
    k = codec.slot_count(n, shape)
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    packet = codec.encode(x, context(shape))
    slot = np.zeros(codec.capacity_for(n, shape), np.uint8)
    slot[:packet.size] = packet
    words = slot.view(np.uint32)
    W, m = 12, int(words[1])
    assert int(words[5]) >= 2
    first = 5 + 3 * W
    if breakage == "count":
        words[1] = k + 1
    elif breakage == "total":           # the columns' counts add up to more
        words[1] = m - 1
    elif breakage == "H":
        words[4] = 11
    elif breakage == "column count":
        words[5] += 1
    elif breakage == "order":
        words[first], words[first + 1] = words[first + 1], words[first]
    else:                               # a row past the column's 33
        words[first + int(words[5]) - 1] = (33 << 1) | 1
    check_refused(codec, slot, n, k, context(shape), general=False)
    assert m >= 2


def test_slot_entries_and_subclasses():
    """One group of columns (about 65536 elements); a subclass that changes a
    step gets none."""
    from hpccomm.codecs.adaptive import Adaptive

    class Wider(Adaptive):
        def column_length(self, n, shape):
            return min(n, 2 * super().column_length(n, shape))

    codec = Adaptive(proportion=8)
    assert codec.slot_count(1000, (1000,)) == codec.max_count(1000, 1000)
    assert codec.slot_count(65536, (512, 128)) is not None
    assert codec.slot_count(65536 + 128, (513, 128)) is None
    assert codec.slot_count(100, None) is None
    assert Wider().slot_count(100, (100,)) is None
