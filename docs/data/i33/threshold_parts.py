"""Where threshold's encode with feedback spends its time at 16M float32,
one thread: the read of ``x`` for ``alpha``'s RMS, the one pass
(:func:`hpccomm.kernels.sparsify.compensate_sign_quanta`) at 1.2 %
candidates and at none, against ``np.add`` and ``np.copyto`` of the same
arrays, and the whole encode; medians of 7.

    python docs/data/i33/threshold_parts.py
"""
import time

import numpy as np

import hpccomm
from hpccomm.codecs.base import EncodeContext
from hpccomm.kernels import sparsify as K
from hpccomm.kernels import threads

threads.set_threads(1)
n = 1 << 24
rng = np.random.default_rng(1)
x = rng.standard_normal(n).astype(np.float32)
e = rng.standard_normal(n).astype(np.float32) * np.float32(0.1)
v = np.empty_like(x)
words = np.dtype(np.uint32)


def ms(f, reps=7):
    f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return np.median(ts) * 1e3


codec = hpccomm.get_codec("threshold", alpha=2.5)
for name, f in [("np.add x + e -> v", lambda: np.add(x, e, out=v)),
                ("np.copyto", lambda: np.copyto(v, x)),
                ("sum_squares(x)", lambda: K.sum_squares(x)),
                ("one pass, tau 2.5 (1.2 %)",
                 lambda: K.compensate_sign_quanta(x, e, v, 2.5, n // 4, words)),
                ("one pass, tau 99 (none)",
                 lambda: K.compensate_sign_quanta(x, e, v, 99.0, n // 4, words)),
                ("encode_with_feedback, alpha 2.5",
                 lambda: codec.encode_with_feedback(x, e, v, EncodeContext()))]:
    print(f"{name:34s} {ms(f):6.2f} ms")
