"""Where topk's encode with feedback spends its time at 16M float32, ratio
0.01, one thread: the sample and its threshold, the one pass
(:func:`hpccomm.kernels.sparsify.compensate_select`) at the sample's
threshold and at none, the cut to exactly k (``keep_largest``), the packet
and the residual's correction, against ``np.add`` of the same arrays, and the
whole encode; medians of 7.

    python docs/data/i33/topk_parts.py
"""
import time

import numpy as np

import hpccomm
from hpccomm.codecs.base import EncodeContext
from hpccomm.codecs.topk import pack_pairs
from hpccomm.kernels import sparsify as K
from hpccomm.kernels import threads

threads.set_threads(1)
n = 1 << 24
rng = np.random.default_rng(1)
x = rng.standard_normal(n).astype(np.float32)
e = rng.standard_normal(n).astype(np.float32) * np.float32(0.1)
v = np.empty_like(x)
codec = hpccomm.get_codec("topk", ratio=0.01)
ctx = EncodeContext()
k = codec.max_count(n)
s = codec.sample_size(n)
idt = np.dtype(np.uint32)


def ms(f, reps=7):
    f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return np.median(ts) * 1e3


sample = K.strided_sample_abs(x, s, codec._key(ctx), 0, e)
t = codec._threshold(sample, n, k)
frac = np.count_nonzero(sample >= t) / s
idx, vals, _ = K.compensate_select(x, e, v, t, idt, frac)
print(f"k = {k}, sample {s}, candidates {idx.size} ({idx.size / k:.2f} k)")
for name, f in [
        ("np.add x + e -> v", lambda: np.add(x, e, out=v)),
        ("sample |x + e|", lambda: K.strided_sample_abs(x, s, codec._key(ctx), 0, e)),
        ("threshold of the sample", lambda: codec._threshold(sample, n, k)),
        ("one pass at t", lambda: K.compensate_select(x, e, v, t, idt, frac)),
        ("one pass, none pass", lambda: K.compensate_select(x, e, v, 1e9, idt, frac)),
        ("keep_largest", lambda: K.keep_largest(idx, vals, k)),
        ("pack_pairs", lambda: pack_pairs(codec, n, idx[:k], vals[:k])),
        ("subtract_at", lambda: K.subtract_at(v, idx[:k], vals[:k] * 0)),
        ("encode_with_feedback", lambda: codec.encode_with_feedback(x, e, v, ctx))]:
    print(f"{name:28s} {ms(f):6.2f} ms")
