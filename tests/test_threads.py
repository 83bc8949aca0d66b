"""Kernels on several threads give the bits of one thread.

The test runner pins every test process to one numba thread (ranks share the
cores), so these checks run in a child process with two: the onebit kernels
(tiles of whole columns) and the sparsifiers' block-parallel passes, through
hpccomm's thread setting (:mod:`hpccomm.kernels.threads`)."""
import os
import subprocess
import sys

import pytest

import hpccomm
from hpccomm.kernels import threads

ONEBIT = r'''
import numpy as np
import hpccomm
from hpccomm.codecs.base import EncodeContext
from hpccomm.collectives.transport import Received
from hpccomm.kernels import onebit as K
from hpccomm.kernels import threads

calls = []
for name in ("onebit_encode_tiles", "onebit_decode_tiles", "onebit_decode_sum_tiles"):
    kernel = getattr(K, name)
    setattr(K, name, lambda *a, _k=kernel, _n=name: (calls.append(_n), _k(*a))[1])

def run(codec, x, e, shape):
    n = x.size
    ctx = EncodeContext(seed=3, shape=shape)
    e_out = np.full(n, np.nan, np.float32)
    packet = codec.encode_with_feedback(x, e, e_out, ctx)
    plain = codec.encode(x, ctx)
    decoded = codec.decode(packet, np.empty(n, np.float32))
    added = codec.decode_add(plain, decoded.copy())
    # an owner step over three ranks' packets, with and without owner memory
    packets = [codec.encode(x * np.float32(k + 1), ctx) for k in range(3)]
    buf = np.concatenate(packets)
    sizes = [p.size for p in packets]
    got = Received(buf, sizes, [sum(sizes[:k]) for k in range(3)])
    outs = []
    for eo in (np.zeros(n, np.float32), None):
        out = np.empty(n, np.float32)
        op = codec.owner_step(got, e, eo, out, ctx)
        outs += [op.tobytes(), out.tobytes(), b"" if eo is None else eo.tobytes()]
    return [packet.tobytes(), e_out.tobytes(), plain.tobytes(), decoded.tobytes(),
            added.tobytes(), *outs]

cases = [((1 << 18) + 77, None), (3 * 65536 + 4097 * 5 + 3, None), (4097 * 70, (70, 4097)),
         (7 * 40000, (40000, 7)), (33 * 9000, (9000, 33))]
for n, shape in cases:
    shape = shape or (n,)
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    x[:4] = (0.0, -0.0, 1e-40, -3.0)
    e = rng.standard_normal(n).astype(np.float32) * np.float32(0.1)
    for codec in (hpccomm.get_codec("onebit"), hpccomm.get_codec("onebit", col_len=1000)):
        for ee in (e, None):
            threads.set_threads(1)
            one = run(codec, x, ee, shape)
            assert not calls, "one thread ran a parallel kernel"
            threads.set_threads(2)
            two = run(codec, x, ee, shape)
            assert set(calls) == {"onebit_encode_tiles", "onebit_decode_tiles",
                                  "onebit_decode_sum_tiles"}, calls
            calls.clear()
            bad = [i for i, (a, b) in enumerate(zip(one, two)) if a != b]
            assert not bad, (n, shape, codec, ee is None, bad)
print("same bits")
'''

SPARSE = r'''
import numpy as np
from hpccomm.codecs import EncodeContext, get_codec
from hpccomm.kernels import threads
from hpccomm.kernels.sparsify import BLOCK

n = 3 * BLOCK + 5  # several blocks of the parallel passes
x = np.random.default_rng(24).standard_normal(n).astype(np.float32)
ctx = EncodeContext(seed=1, shape=(n // 5, 5))
codecs = [get_codec("topk", ratio=0.01), get_codec("dgc", ratio=0.01),
          get_codec("threshold", alpha=2.0), get_codec("adaptive", proportion=2)]
packets = []
for k in (1, 2):
    threads.set_threads(k)
    packets.append([c.encode(x, ctx).tobytes() for c in codecs])
for c, one, two in zip(codecs, *packets):
    assert one == two, c
print("same bits")
'''


@pytest.mark.parametrize("script", [ONEBIT, SPARSE], ids=["onebit", "sparsifiers"])
def test_two_threads_give_the_bits_of_one(script):
    """onebit: encode with and without feedback, decode, decode-add and the
    owner step, over 1-D and 2-D shapes whose columns divide neither a tile
    nor a sign word (and a check that the parallel kernels ran).
    Sparsifiers: the packets of topk, dgc, threshold and adaptive."""
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    env.pop("HPCCOMM_THREADS", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0 and "same bits" in proc.stdout, proc.stderr[-3000:]


def test_thread_setting():
    """set_threads / HPCCOMM_THREADS / the node fit, capped by numba's pool."""
    import numba

    cap = numba.config.NUMBA_NUM_THREADS
    try:
        hpccomm.set_threads(64)
        assert threads.get() == cap
        assert threads.for_node(1) == (
            cap, f"set_threads(64), at most NUMBA_NUM_THREADS = {cap}" if cap < 64 else
            "set_threads(64)")
        hpccomm.set_threads(1)
        assert threads.get() == 1 and threads.for_node(1) == (1, "set_threads(1)")
        os.environ["HPCCOMM_THREADS"] = "2"
        assert threads.get() == min(2, cap)
        assert threads.for_node(1)[1].startswith("HPCCOMM_THREADS=2")
        del os.environ["HPCCOMM_THREADS"]
        hpccomm.set_threads(None)
        cores = len(os.sched_getaffinity(0))
        assert threads.for_node(cores * 4) == (1, f"{cores} cores / {cores * 4} ranks on the node")
        threads.fit_to_node(cores * 4)   # more ranks than cores
        assert threads.get() == 1
        with pytest.raises(ValueError, match="positive integer"):
            hpccomm.set_threads(0)
    finally:
        os.environ.pop("HPCCOMM_THREADS", None)
        hpccomm.set_threads(None)
