"""Wire size of ``qsgd(elias=True)`` against the fixed-width codes, on
Gaussian input of 2^22 elements (two seeds): bits per element of the packet,
the paper's part of it (scales and Elias bits, without the per-bucket table
and padding), QSGD's expected-size bound (Alistarh et al., Theorem 3.2, log2,
without the o(1) term), the worst case and the non-zero fraction
(docs/results/codecs-new.md, *qsgd(elias=True)*).  ``python docs/elias_sizes.py``"""
import math, numpy as np, hpccomm
from hpccomm.codecs.base import EncodeContext
n = 1 << 22
x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
def bound(s, d):
    k = s * (s + math.sqrt(d))
    return (3 + 1.5 * math.log2(2 * (s * s + d) / k)) * k + 32
print(f"{'bits':>4} {'d':>6} {'norm':>4} {'fixed':>7} {'elias':>7} {'paper part':>10} {'bound':>8} {'worst':>7} {'nnz/elt':>7}")
for bits, d in [(2, 512), (4, 512), (8, 512), (2, 128), (4, 128), (8, 128), (4, 49), (8, 16129)]:
    for norm in ("l2", "max"):
        f = hpccomm.get_codec("qsgd", bits=bits, bucket=d, norm=norm)
        e = hpccomm.get_codec("qsgd", bits=bits, bucket=d, norm=norm, elias=True)
        nb = -(-n // d)
        sizes, Ts, nnz = [], [], []
        for seed in range(2):
            ctx = EncodeContext(seed=seed)
            p = e.encode(x, ctx)
            sizes.append(p.size)
            Ts.append(p[24 + 4 * nb:24 + 8 * nb].view("<u4").astype(np.int64).sum())
            nnz.append(np.count_nonzero(f.roundtrip(x, ctx)))
        pe, T = np.mean(sizes), np.mean(Ts)
        print(f"{bits:>4} {d:>6} {norm:>4} {8*f.wire_size(n)/n:7.3f} {8*pe/n:7.3f} "
              f"{(T + 32*nb)/n:10.3f} {bound(f.levels, d)/d:8.3f} {8*e.max_wire_size(n)/n:7.3f} {np.mean(nnz)/n:7.3f}")
