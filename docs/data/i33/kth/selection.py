"""The k-th largest value by numba's np.partition against numpy's -- on random
magnitudes and on the sample topk 1 % takes of a 32K chunk in error feedback's
steady state -- and topk's encode with error feedback of that chunk, with a
fresh residual and with the residual carried from step to step (after 20 steps
over 4 changing inputs).  One thread; nothing else running.  Run at 59ea636^
(kth_largest through numba) and after it for the before / after.

    NUMBA_NUM_THREADS=1 python docs/data/i33/kth/selection.py
"""
import time

import numpy as np
from numba import njit

import hpccomm
from hpccomm.codecs.base import EncodeContext
from hpccomm.kernels import sparsify as K


@njit(cache=True)
def numba_kth(a, k):
    return np.partition(a, a.size - k)[a.size - k]


def median_us(fn, reps=200):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return np.median(ts) * 1e6


rng = np.random.default_rng(0)
codec = hpccomm.get_codec("topk")
n = 32768
xs = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
ctx = EncodeContext(shape=(n,))
e, e_out = np.zeros(n, np.float32), np.empty(n, np.float32)
for i in range(20):
    codec.encode_with_feedback(xs[i % 4], e, e_out, ctx)
    e, e_out = e_out, e
k = codec.max_count(n)
s = codec._sample_size(n, k)
steady = K.strided_sample_abs(xs[0], s, codec._key(ctx), ctx.offset, e)
ks = int(np.ceil(1.25 * 0.01 * s))
for label, a, kk in (("random magnitudes", np.abs(rng.standard_normal(s)).astype(np.float32), ks),
                     ("topk's steady-state sample", steady, ks),
                     ("random magnitudes", np.abs(rng.standard_normal(1 << 20)).astype(np.float32),
                      (1 << 20) // 80)):
    print(f"k-th largest of {a.size} {label}: numba {median_us(lambda: numba_kth(a, kk), 50):.1f} us, "
          f"hpccomm {median_us(lambda: K.kth_largest(a, kk), 50):.1f} us")

fresh = (rng.standard_normal(n) * 0.1).astype(np.float32)
state = {"i": 0, "e": e, "e_out": e_out}


def carried():
    codec.encode_with_feedback(xs[state["i"] % 4], state["e"], state["e_out"], ctx)
    state["e"], state["e_out"] = state["e_out"], state["e"]
    state["i"] += 1


print(f"topk encode with feedback, {n}: fresh residual "
      f"{median_us(lambda: codec.encode_with_feedback(xs[0], fresh, e_out.copy(), ctx)):.1f} us, "
      f"residual carried {median_us(carried):.1f} us")
