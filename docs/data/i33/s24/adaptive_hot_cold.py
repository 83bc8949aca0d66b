"""Whether adaptive's column work overlaps its memory stream: the stages of
:func:`hpccomm.kernels.sparsify.adaptive_encode`'s column loop (as in
``../s13/adaptive_stages.py``: ``v = x + e`` formed column by column, the
draws' hashes, their gather, the sampled thresholds, the selection) added one
at a time, once over the whole 16M vector ("cold": every column comes from
memory) and once over 16 columns in turn ("hot": 768 KiB, in L2), with the
same draws.  Medians of 11, the stages alternated; one thread.
``python adaptive_hot_cold.py`` (hpccomm importable)."""
import time

import numba
import numpy as np
from numba import njit

from hpccomm.kernels import sparsify as S
from hpccomm.kernels.rng import stream_key

numba.set_num_threads(1)
n = 16 << 20; H = 4096; pi = 64; samples = 512
rng = np.random.default_rng(0)
x = rng.standard_normal(n, dtype=np.float32); e = rng.standard_normal(n, dtype=np.float32) * 0.1
eo = np.empty_like(x)
key = stream_key(1, 0, 0, 0x61646170)


@njit(cache=False, nogil=True)
def run(x, e, eo, H, pi, samples, key, level, hot, words):
    n = x.size; W = (n + H - 1) // H
    rows = np.empty(samples, np.int64); drawn = np.empty(samples, np.float32)
    pos = np.empty(samples + 1, np.float32); neg = np.empty(samples + 1, np.float32)
    base = np.uint64(0); acc = 0.0
    for c in range(W):
        lo = c * H; h = min(lo + H, n) - lo
        at = (c % 16) * H if hot else lo
        col = eo[at:at + h]
        S._compensate(x[at:at + h], e[at:at + h], True, col)
        if level >= 1:
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
names = ["v formed", "+hash", "+gather", "+thresholds", "+select"]
print("ms, stages added one at a time:", ", ".join(names))
for hot in (1, 0):
    T = {lv: [] for lv in range(5)}
    for lv in range(5):
        run(x, e, eo, H, pi, samples, key, lv, hot, words)
    for r in range(11):
        for lv in range(5):
            t0 = time.perf_counter()
            run(x, e, eo, H, pi, samples, key, lv, hot, words)
            T[lv].append(time.perf_counter() - t0)
    print("hot " if hot else "cold", " ".join(f"{np.median(T[lv]) * 1e3:6.2f}" for lv in range(5)))
t = []
for r in range(11):
    t0 = time.perf_counter(); np.add(x, e, out=eo); t.append(time.perf_counter() - t0)
print(f"np.add of the same arrays {np.median(t) * 1e3:.2f} ms")
