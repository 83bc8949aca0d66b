"""fp16 / bf16's owner step alone: ``python half_owner_step.py LABEL``.
Three received rows of 8M half-precision bit patterns (strided, as several
packets in one buffer), error feedback on; medians of 9 calls after one
warm-up, one thread.  Prints ``LABEL format ms``."""
import sys
import time

import numpy as np

from hpccomm.kernels import halfwidth as K

n = 1 << 23
rng = np.random.default_rng(0)
wide = np.zeros((3, n + 64), np.uint16)
for row in wide:
    row[:n] = rng.standard_normal(n).astype(np.float16).view(np.uint16)
rows = wide[:, :n]
e = (rng.standard_normal(n) * 1e-3).astype(np.float32)
bits = np.empty(n, np.uint16)
e_out = np.empty(n, np.float32)
out = np.empty(n, np.float32)
for bf16 in (False, True):
    K.half_owner_step(rows, bf16, e, True, True, bits, e_out, out)
    times = []
    for _ in range(9):
        t0 = time.perf_counter()
        K.half_owner_step(rows, bf16, e, True, True, bits, e_out, out)
        times.append(time.perf_counter() - t0)
    print(sys.argv[1], "bf16" if bf16 else "fp16", f"{1e3 * sorted(times)[4]:.2f} ms")
