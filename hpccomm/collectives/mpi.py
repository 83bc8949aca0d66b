"""``mpi``: plain ``MPI_Allreduce`` of the dense values -- the baseline and the
fallback.  Carries only ``codec="none"``; reduces float32 and float64 natively
and device buffers directly when MPI is CUDA-aware.
"""
from mpi4py import MPI

from .base import Algorithm, register_algorithm


@register_algorithm
class MpiAllreduce(Algorithm):
    name = "mpi"
    dtypes = ("float32", "float64")
    supports_device = True

    def check_codec(self, codec):
        if codec.name != "none":
            raise ValueError(f"algorithm 'mpi' sends dense values and takes codec='none', not "
                             f"{codec.name!r}; pick a compressed algorithm such as 'twoshot'")

    def _account(self, nbytes, call):
        p = self.size
        moved = 2 * (p - 1) * nbytes // p if p > 1 else 0
        call.sent(moved)
        call.received(moved)
        call.modelled = True

    def reduce(self, x, out, state, call, ctx):
        call.n = x.size
        if self.size == 1 or x.size == 0:
            out[...] = x
            return
        with call.time("comm"):
            self.comm.Allreduce(x, out, op=MPI.SUM)
        self._account(x.nbytes, call)

    def reduce_device(self, x, out, backend, state, call, ctx):
        """``x`` and ``out`` are device arrays; MPI reads them directly."""
        nbytes = call.nbytes
        if self.size == 1:
            backend.copy(x, out)
            return
        with call.time("comm"):
            self.comm.Allreduce(x, out, op=MPI.SUM)
        self._account(nbytes, call)
