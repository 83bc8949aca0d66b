"""Kernel launches, copies and host waits per call of the device path, for
every codec with a device twin through ``twoshot`` -- the host code a GPU
runs, counted under numba's CUDA simulator with the test harness
(``tests/cudasim.py``), which records every launch, copy and allocation and
the stream it went to.

    mpiexec -n 3 env NUMBA_ENABLE_CUDASIM=1 python docs/device_launches.py [N]

One row per codec, the largest count over the ranks for the second call of a
key with error feedback on (input on a stream of its own): kernel launches,
device-to-host and host-to-device copies, device allocations, and host waits
for the stream (a copy that must be complete, a count read back).  Every
launch and copy is checked to run on the input's stream.
"""
import os
import sys
import warnings

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import cudasim  # noqa: E402

cudasim.install()
warnings.simplefilter("ignore")

import hpccomm  # noqa: E402
from hpccomm.buffers.host_device import HostDeviceArray, HostDeviceBackend  # noqa: E402
from hpccomm.device_codecs import device_codec_names  # noqa: E402

#: the input's stream
STREAM = 0xBEEF
PARAMS = {"topk": {"ratio": 0.01}, "dgc": {"ratio": 0.01}, "randk": {"ratio": 0.01}}


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096 + 3
    comm = MPI.COMM_WORLD
    hpccomm.register_device_backend(HostDeviceBackend(device_kernels=True))
    waits = [0]

    def synchronize(stream):
        waits[0] += 1

    cudasim.SimStream.synchronize = synchronize
    x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    if comm.rank == 0:
        print(f"# device path, P = {comm.size}, n = {n}, twoshot, error feedback on, second call")
        print(f"{'codec':>10} {'launches':>9} {'to host':>8} {'to device':>10} {'allocs':>7} "
              f"{'host waits':>11}")
    for codec in device_codec_names():
        r = hpccomm.Allreducer(comm, codec=codec, algorithm="twoshot", error_feedback=True,
                               **PARAMS.get(codec, {}))
        r(HostDeviceArray(x.copy(), stream=STREAM), key="g")
        waits[0] = 0
        with cudasim.record_streams() as log:
            r(HostDeviceArray(x.copy(), stream=STREAM), key="g")
        assert all(getattr(s, "handle", None) == STREAM for _, s in log), codec
        kinds = [what for what, _ in log]
        row = (sum(k.startswith("launch") for k in kinds), kinds.count("copy_to_host"),
               kinds.count("copy_to_device") + kinds.count("to_device"),
               kinds.count("device_array"), waits[0])
        rows = comm.gather(row)
        if comm.rank == 0:
            worst = [max(c) for c in zip(*rows)]
            print(f"{codec:>10} {worst[0]:>9} {worst[1]:>8} {worst[2]:>10} {worst[3]:>7} "
                  f"{worst[4]:>11}", flush=True)


if __name__ == "__main__":
    main()
