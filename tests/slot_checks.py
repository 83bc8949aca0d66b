"""The checks that the slot tests share (test_exact_topk.py,
test_threshold_slots.py, test_adaptive_slots.py): a codec's slot kernels
against its general steps, on the packet bytes, the residual bits and the
result bits; a broken slot refused."""
from dataclasses import replace

import numpy as np
import pytest

from hpccomm.codecs.base import EncodeContext
from hpccomm.errors import PacketError
from hpccomm.kernels.slots import BAD_PACKET


def bits(a):
    return a.view(np.uint32).tobytes()


def slot_for(codec, n, shape=None):
    """A slot of ``n`` elements of a tensor of ``shape`` (``(n,)``) laid out,
    stale bytes in it: ``(slot, views)``."""
    shape = (n,) if shape is None else shape
    slot = np.full(codec.capacity_for(n, shape), 0xEE, np.uint8)
    return slot, codec.slot_views(slot, n, shape)


def check_encode(codec, x, e, ctx=EncodeContext()):
    """``encode_slot`` against ``encode_with_feedback`` in ``ctx``."""
    n = x.size
    shape = ctx.shape or (n,)
    ctx = replace(ctx, shape=shape)
    want_e = np.empty(n, np.float32)
    want = codec.encode_with_feedback(x, e, want_e, ctx)
    slot, views = slot_for(codec, n, shape)
    got_e = np.empty(n, np.float32)
    assert codec.encode_slot(views, x, e, got_e, codec.draw(ctx)) == 0
    assert codec.packet_in_slot(slot, n).tobytes() == want.tobytes()
    assert bits(got_e) == bits(want_e)


def check_owner(codec, inputs, e, memory, ctx=EncodeContext()):
    """``owner_slot`` on the slots of the packets of ``inputs`` (one per
    rank; each packet shorter than its slot, stale bytes after it) against
    ``owner_step`` on the packets: the owner's packet, its slice of ``out``
    and its residual (``memory``: "residual" with ``e``, "fresh" without,
    "none"), the owner encoding in ``ctx``; then ``decode_slot`` of the
    owner's slot."""
    n = inputs[0].size
    shape = ctx.shape or (n,)
    ctx = replace(ctx, shape=shape)
    entries = codec.slot_count(n, shape)
    rows = np.full((len(inputs), codec.capacity_for(n, shape)), 0xEE, np.uint8)
    packets = []
    for j, x in enumerate(inputs):
        packet = codec.encode(x, replace(ctx, rank=j))
        rows[j, :packet.size] = packet
        packets.append(packet)
    want_e = None if memory == "none" else np.empty(n, np.float32)
    want_out = np.empty(n, np.float32)
    want = codec.owner_step(packets, e, want_e, want_out, ctx)
    slot, views = slot_for(codec, n, shape)
    got_e = None if memory == "none" else np.empty(n, np.float32)
    got_out = np.full(n, np.nan, np.float32)
    assert codec.owner_slot(codec.row_views(rows, n, shape), entries, e, got_e, got_out, views,
                            codec.draw(ctx)) == 0
    assert codec.packet_in_slot(slot, n).tobytes() == want.tobytes()
    assert bits(got_out) == bits(want_out)
    if want_e is not None:
        assert bits(got_e) == bits(want_e)
    dec = np.full(n, np.nan, np.float32)
    assert codec.decode_slot(codec.row_views(slot, n, shape), entries, dec)
    assert bits(dec) == bits(codec.decode(want, np.empty(n, np.float32)))


def check_refused(codec, slot, n, entries, ctx=EncodeContext(), general=True):
    """A broken ``slot`` of ``n`` elements (at most ``entries``): the owner's
    and the decoder's slot kernels refuse it (:data:`BAD_PACKET`, False)
    without writing ``out``; with ``general``, the codec's own decode of its
    packet raises :class:`~hpccomm.errors.PacketError` too."""
    shape = ctx.shape or (n,)
    out = np.full(n, 7, np.float32)
    views = slot_for(codec, n, shape)[1]
    assert codec.owner_slot(codec.row_views(np.stack([slot, slot]), n, shape), entries, None,
                            None, out, views, codec.draw(ctx)) == BAD_PACKET
    assert not codec.decode_slot(codec.row_views(slot, n, shape), entries, out)
    assert np.all(out == 7)
    if general:
        with pytest.raises(PacketError):
            codec.decode(codec.packet_in_slot(slot, n), out)
