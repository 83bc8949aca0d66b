"""``rle_pipeline``: a pipelined run-length-encoded reduce + broadcast, in the
spirit of Hofmann & Rünger (EuroPVM/MPI 2008).

The vector is cut into blocks of ``block`` elements (the last one ragged),
each run-length encoded on its own (:mod:`hpccomm.kernels.merge`): word 0 is
the number of segments, each segment ``[zero_run, nz_run, nz_run float32
values]`` (uint32 words, a trailing zero run implicit), or -- the per-block
dense fallback, chosen whenever the RLE form is not smaller -- word 0 is
``0xFFFFFFFF`` followed by the block's float32 values.

1. **Reduce along a chain** ``P-1 -> P-2 -> ... -> 0``: rank ``r`` encodes its
   block ``b``, merges it with the partial sum of ranks ``r+1 .. P-1`` for
   block ``b`` that arrived from ``r+1`` (``own (+) received``, its own block
   the left operand; two RLE blocks are merged without decoding them; RLE into
   dense otherwise) and sends the result on to ``r-1`` with ``MPI_Isend``.
   Receives for the next ``window`` blocks are posted ahead with
   ``MPI_Irecv`` into buffers of the largest block message
   (``4 (block + 1)`` bytes), and the actual size is read from the status:
   no count messages.  While block ``b`` travels, block ``b + 1`` is being
   encoded and merged: encode, transfer and merge of consecutive blocks
   overlap.  Rank 0 ends with the encoded sum, ``x_0 + (x_1 + (... + x_{P-1}))``.
2. **Broadcast along the chain** ``0 -> 1 -> ... -> P-1``, pipelined the
   same way: each rank forwards block ``b`` unchanged to ``r+1`` as soon as
   it arrives and decodes it while the next blocks are in flight.

Messages of one direction use one tag; MPI's non-overtaking rule delivers
them in block order into the receives posted in block order.

Bit identity: rank 0 alone computes the sum; every rank, rank 0 included,
decodes the same bytes.

Cost (``B`` blocks, ``S_r`` = encoded size of the partial sum
``x_r + ... + x_{P-1}``, at most ``4 n + 4 B`` bytes): rank ``r`` sends
``S_r`` up and the final result ``S_0`` down (not the last rank), receives
``S_{r+1}`` and ``S_0``; time about ``(P - 1 + B)`` block stages per phase
(pipeline fill plus one stage per block).  Good for data that are sparse *and*
clustered (runs) or moderately dense; latency grows linearly with ``P``.
With a :class:`~hpccomm.SparseVector` input, ``B = ceil(n / block)``
messages are sent however few the non-zeros: meant for vectors that would
also fit densely.
"""
from __future__ import annotations

import numpy as np

from ...errors import PacketError
from ...kernels import merge as K
from ..base import register_algorithm
from .base import SparseAlgorithm, index_dtype

TAG_REDUCE = 11
TAG_BCAST = 12


def encode_block(idx, vals, lo, m) -> np.ndarray:
    """The block ``[lo, lo + m)`` of sorted pairs: RLE words, or the dense
    form when the RLE form is not smaller."""
    words = K.rle_encode_pairs(idx, vals, lo, m)
    if words.size >= 1 + m:
        return K.rle_dense_words(K.densify(idx, vals, lo, lo + m))
    return words


def merge_blocks(own: np.ndarray, other: np.ndarray, m: int) -> np.ndarray:
    """``own (+) other`` for two encoded blocks of ``m`` elements."""
    if own[0] != K.RLE_DENSE and other[0] != K.RLE_DENSE:
        words = K.rle_merge(own, other)
        if words.size < 1 + m:
            return words
        return K.rle_dense_words(K.rle_decode(words, m))
    if own[0] == K.RLE_DENSE:
        acc = K.rle_decode(own, m)
        K.rle_add_into(other, acc)
    else:  # other dense: other + own == own + other bitwise
        acc = K.rle_decode(other, m)
        K.rle_add_into(own, acc)
    return K.rle_dense_words(acc)


class _Receiver:
    """Receives posted ``window`` messages ahead from one source, in order."""

    def __init__(self, net, source, tag, count, max_bytes, window):
        self.net, self.source, self.tag, self.count = net, source, tag, count
        self.window = max(1, min(window, count))
        self.bufs = [np.empty(max_bytes, dtype=np.uint8) for _ in range(self.window)]
        self.reqs = [self._post(b) for b in range(self.window)]

    def _post(self, b):
        return self.net.irecv(self.bufs[b % self.window], self.source, self.tag)

    def get(self, b, m) -> np.ndarray:
        """Block ``b``'s message (of ``m`` values) as uint32 words (a copy),
        checked (:func:`~hpccomm.kernels.merge.rle_valid`), reposting its buffer."""
        slot = b % self.window
        got = self.reqs[slot].wait()
        if got.size % 4 or not K.rle_valid(words := got.view(np.uint32).copy(), m):
            raise PacketError(f"rle_pipeline: block {b} from rank {self.source} "
                              f"({got.size} bytes) is not a run-length block of {m} values")
        if b + self.window < self.count:
            self.reqs[slot] = self._post(b + self.window)
        return words


@register_algorithm
class RlePipeline(SparseAlgorithm):
    name = "rle_pipeline"

    def __init__(self, comm, codec, block=16384, window=4):
        super().__init__(comm, codec)
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
            raise ValueError(f"rle_pipeline: block must be a positive integer, not {block!r}")
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
            raise ValueError(f"rle_pipeline: window must be a positive integer, not {window!r}")
        self.block, self.window = int(block), int(window)

    def params(self):
        return {"block": self.block, "window": self.window}

    def reduce_sparse(self, idx, vals, n, state, net, out=None):
        P, r, call = self.size, self.rank, net.call
        block = self.block
        nblocks = -(-n // block)
        starts = [b * block for b in range(nblocks + 1)]
        starts[-1] = n
        cuts = np.searchsorted(idx, np.asarray(starts, dtype=np.int64))
        max_bytes = 4 * (block + 1)
        child = r + 1 if r + 1 < P else None
        parent = r - 1 if r > 0 else None
        sends = []

        def isend(words, dest, tag):
            sends.append(net.isend(words.view(np.uint8), dest, tag))

        # 1. chain reduce towards rank 0
        up = (_Receiver(net, child, TAG_REDUCE, nblocks, max_bytes, self.window)
              if child is not None and nblocks else None)
        final = []
        for b in range(nblocks):
            lo, m = starts[b], starts[b + 1] - starts[b]
            with call.time("encode"):
                words = encode_block(idx[cuts[b]:cuts[b + 1]], vals[cuts[b]:cuts[b + 1]], lo, m)
            if up is not None:
                theirs = up.get(b, m)
                with call.time("decode"):
                    words = merge_blocks(words, theirs, m)
            if parent is not None:
                isend(words, parent, TAG_REDUCE)
            else:
                final.append(words)
        # 2. chain broadcast from rank 0; each block is decoded as it arrives
        down = (_Receiver(net, parent, TAG_BCAST, nblocks, max_bytes, self.window)
                if parent is not None and nblocks else None)
        pieces = []
        dense_blocks = 0
        probe = np.zeros(1, index_dtype(n))
        for b in range(nblocks):
            lo, m = starts[b], starts[b + 1] - starts[b]
            words = final[b] if down is None else down.get(b, m)
            if child is not None:
                isend(words, child, TAG_BCAST)
            dense_blocks += int(words[0] == K.RLE_DENSE)
            with call.time("decode"):
                if out is not None:
                    K.rle_decode_into(words, out[lo:lo + m])
                else:
                    pieces.append(K.drop_zeros(*K.rle_to_pairs(words, lo, m, probe)))
        for req in sends:
            req.wait()
        call.extra.update(blocks=nblocks, dense_blocks=dense_blocks, went_dense=dense_blocks > 0)
        if out is not None:
            return None
        if not pieces:
            return np.empty(0, probe.dtype), np.empty(0, np.float32)
        return np.concatenate([i for i, _ in pieces]), np.concatenate([v for _, v in pieces])
