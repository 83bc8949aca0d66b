"""Bytes that cross between device and host per call on the device path,
against the gradient's size: every codec with a device twin, ``twoshot`` and
``allgather``, under numba's CUDA simulator (host memory standing in for
device memory, so the bytes are real and the times are not).

    mpiexec -n 3 env NUMBA_ENABLE_CUDASIM=1 python docs/device_staging.py [N]

Prints one row per (codec, algorithm): the staged bytes to and from the host
(``CallStats.extra``), their sum over the gradient's ``4 N`` bytes each way,
the bytes this rank's MPI calls moved (``bytes_sent + bytes_recv``), and
whether the result equals the host path's, bit for bit, on every rank.
"""
import sys
import warnings

import numpy as np
from mpi4py import MPI

import hpccomm
from hpccomm.buffers.host_device import HostDeviceArray, HostDeviceBackend
from hpccomm.device_codecs import device_codec_names

warnings.simplefilter("ignore")


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 14
    comm = MPI.COMM_WORLD
    backend = HostDeviceBackend(device_kernels=True)
    hpccomm.register_device_backend(backend)
    x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    if comm.rank == 0:
        print(f"# device path, P = {comm.size}, n = {n} float32 ({4 * n} B), step 2 of a key "
              "with error feedback on")
        print(f"{'codec':>10} {'algorithm':>10} {'to host B':>10} {'to device B':>11} "
              f"{'/ 8n':>7} {'MPI B':>9} {'=host':>6}")
    for codec in device_codec_names():
        for algorithm in ("twoshot", "allgather"):
            host = hpccomm.Allreducer(comm, codec=codec, algorithm=algorithm, error_feedback=True)
            dev = hpccomm.Allreducer(comm, codec=codec, algorithm=algorithm, error_feedback=True)
            for _ in range(2):
                want = host(x.copy(), key="g")
                got = dev(HostDeviceArray(x.copy()), key="g")
            last = dev.stats.last
            same = all(comm.allgather(bool(np.array_equal(want.view(np.uint32),
                                                           got.host.view(np.uint32)))))
            d2h, h2d = last.extra["staged_d2h"], last.extra["staged_h2d"]
            if comm.rank == 0:
                print(f"{codec:>10} {algorithm:>10} {d2h:>10} {h2d:>11} "
                      f"{(d2h + h2d) / (8 * n):>7.3f} {last.bytes_sent + last.bytes_recv:>9} "
                      f"{str(same):>6}", flush=True)
    assert backend.to_host_calls == 0 and backend.from_host_calls == 0


if __name__ == "__main__":
    main()
