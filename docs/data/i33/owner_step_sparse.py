"""The sparsifiers' owner step on one chunk, one thread: the fused
``owner_step`` against the separate steps of twoshot's general path
(decode-add of P packets, compensate, re-encode, decode, residual).

    python docs/data/i33/owner_step_sparse.py [M] [P] [CODEC,...]
"""
import sys
import time
from dataclasses import replace

import numba
import numpy as np

import hpccomm
from hpccomm.codecs.base import EncodeContext

numba.set_num_threads(1)
m = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 23
P = int(sys.argv[2]) if len(sys.argv) > 2 else 2
rng = np.random.default_rng(0)
e = (0.3 * rng.standard_normal(m)).astype(np.float32)


def median_ms(f, reps=7):
    f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


names = sys.argv[3].split(",") if len(sys.argv) > 3 else ["topk", "dgc", "threshold", "adaptive"]
for name in names:
    codec = hpccomm.get_codec(name)
    received = [codec.encode(rng.standard_normal(m).astype(np.float32),
                             EncodeContext(seed=1, rank=j)) for j in range(P)]
    ctx = EncodeContext(seed=1, rank=P, step=0, offset=0, feedback=True)
    out, e_out = np.empty(m, np.float32), np.empty(m, np.float32)

    def fused():
        codec.owner_step(received, e, e_out, out, ctx)

    acc, w = np.empty(m, np.float32), np.empty(m, np.float32)

    def separate():
        acc[:] = 0
        for p in received:
            codec.decode_add(p, acc)
        np.add(acc, e, out=w)
        packet = codec.reencode(w, replace(ctx, fresh=acc))   # the owner's fresh part
        codec.decode(packet, out)
        np.subtract(w, out, out=e_out)

    print(f"{name}, chunk of {m}, {P} packets: separate steps {median_ms(separate):.1f} ms, "
          f"fused owner_step {median_ms(fused):.1f} ms")
