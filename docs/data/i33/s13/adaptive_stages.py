"""Where adaptive's encode with feedback spends its time at 16M float32
(columns of 4096, pi = 64, 512 draws per column, one thread): the stages of
:func:`hpccomm.kernels.sparsify.adaptive_encode`'s column loop added one at a
time -- ``v = x + e`` formed column by column, the draws' hashes, their
gather, the sampled thresholds, the selection -- medians of 11 runs, the
stages alternated.  ``python adaptive_stages.py`` (hpccomm importable).
"""
import time

import numba
import numpy as np
from numba import njit

from hpccomm.kernels import sparsify as S
from hpccomm.kernels.rng import stream_key
numba.set_num_threads(1)
n = 16 << 20; H = 4096; pi = 64; samples = 512
rng = np.random.default_rng(0)
x = rng.standard_normal(n, dtype=np.float32); e = (rng.standard_normal(n, dtype=np.float32) * 0.1)
eo = np.empty_like(x)
key = stream_key(1, 0, 0, 0x61646170)
@njit(cache=False, nogil=True)
def part(x, e, eo, H, pi, samples, key, level, words):
    n = x.size; W = (n + H - 1) // H
    rows = np.empty(samples, np.int64); drawn = np.empty(samples, np.float32)
    pos = np.empty(samples + 1, np.float32); neg = np.empty(samples + 1, np.float32)
    base = np.uint64(0); acc = 0.0
    for c in range(W):
        lo = c * H; hi = min(lo + H, n); h = hi - lo
        col = eo[lo:hi]
        S._compensate(x[lo:hi], e[lo:hi], True, col)
        if level == 1 or level >= 2:
            for j in range(samples):
                rows[j] = S._scaled_index(S.hash_index_cpu(key, base + np.uint64(lo + j)), h)
        if level >= 2:
            for j in range(samples):
                drawn[j] = col[rows[j]]
        if level >= 3:
            tp, tn = S._sample_thresholds(drawn, pi, pos, neg)
            acc += tp
        if level >= 4:
            cp, cn, sp, sn = S._select_column(col, tp, tn, words, 0)
            acc += sp
    return acc
words = np.empty(8192, np.uint32)
T = {lv: [] for lv in range(5)}
for lv in range(5): part(x, e, eo, H, pi, samples, key, lv, words)
for r in range(11):
    for lv in range(5):
        t0 = time.perf_counter(); part(x, e, eo, H, pi, samples, key, lv, words); T[lv].append(time.perf_counter() - t0)
names = ["v formed", "+hash", "+gather", "+thresholds", "+select"]
for lv in range(5): print(f"{names[lv]:12s} {np.median(T[lv])*1e3:.2f} ms")
