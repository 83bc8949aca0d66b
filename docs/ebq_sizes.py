"""Bits per element of ``ebq`` on Gaussian input of 2^24 elements (sigma 1
and 0.01) at bounds 1e-3 and 1e-2, the largest error of a round trip against
the bound, and the entropy of the codes (what an ideal entropy coder would
need) (docs/results/codecs-new.md, *ebq*).  ``python docs/ebq_sizes.py``"""
import numpy as np

import hpccomm

n = 1 << 24
print(f"{'bound':>7} {'sigma':>6} {'bits/elem':>9} {'entropy':>8} {'max err':>9}")
for bound in (1e-3, 1e-2):
    codec = hpccomm.get_codec("ebq", bound=bound)
    for sigma in (1.0, 0.01):
        x = (np.random.default_rng(0).standard_normal(n) * sigma).astype(np.float32)
        packet = codec.encode(x)
        y = codec.roundtrip(x)
        err = float(np.max(np.abs(y.astype(np.float64) - x)))
        q = np.rint(x.astype(np.float64) / codec.step).astype(np.int64)
        _, counts = np.unique(q, return_counts=True)
        p = counts / n
        entropy = float(-(p * np.log2(p)).sum())
        assert err <= bound, (bound, sigma, err)
        print(f"{bound:7.0e} {sigma:6.2f} {8 * packet.size / n:9.3f} {entropy:8.3f} {err:9.3g}")
