"""Relative L2 error of one encode-decode round trip with and without
``rotate=True``, on Gaussian and Student-t (nu = 3) input of 2^20 elements,
mean of three seeds, for rotation blocks of 256, 1024 and 4096
(docs/results/codecs-new.md, *Rotation*).  ``python docs/rotation_error.py``"""
import numpy as np, hpccomm
from hpccomm.codecs import EncodeContext
n = 1 << 20
cases = [("qsgd", dict(bits=4)), ("qsgd", dict(bits=4, norm="max")), ("qsgd", dict(bits=2)),
         ("qsgd", dict(bits=2, norm="max")), ("onebit", {}), ("fp8", {})]
blocks = [None, 256, 1024, 4096]
print("dist   codec                         " + "  ".join(f"{str(b):>8}" for b in ["plain"] + blocks[1:]) + "   best ratio")
for dist in ("gauss", "t3"):
    for name, kw in cases:
        row = []
        for B in blocks:
            c = hpccomm.get_codec(name, **kw) if B is None else hpccomm.get_codec(name, rotate=True, rotate_block=B, **kw)
            errs = []
            for seed in range(3):
                g = np.random.default_rng(100 + seed)
                x = (g.standard_normal(n) if dist == "gauss" else g.standard_t(3, n)).astype(np.float32)
                y = c.roundtrip(x, EncodeContext(seed=seed))
                errs.append(np.linalg.norm((y - x).astype(np.float64)) / np.linalg.norm(x.astype(np.float64)))
            row.append(np.mean(errs))
        label = name + "(" + ",".join(f"{k}={v}" for k, v in kw.items()) + ")"
        print(f"{dist:6} {label:28} " + "  ".join(f"{e:8.4f}" for e in row) + f"   {row[0] / min(row[1:]):.2f}x (1024: {row[0]/row[2]:.2f}x)")
