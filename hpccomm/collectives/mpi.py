"""``mpi``: plain ``MPI_Allreduce`` of the dense values -- the baseline and the
fallback.  Carries only ``codec="none"``; reduces float32 and float64 natively
and device buffers directly when MPI is CUDA-aware.
"""
from .base import Algorithm, register_algorithm


@register_algorithm
class MpiAllreduce(Algorithm):
    name = "mpi"
    dtypes = ("float32", "float64")
    supports_device = True

    def check_codec(self, codec):
        if codec.name != "none":
            raise ValueError(f"algorithm 'mpi' sends dense values and takes codec='none', not "
                             f"{codec.name!r}; pick a compressed algorithm such as 'twoshot', or 'auto'")

    def sends_dense(self, n, shape, key):
        return True

    def reduce(self, x, out, state, ctx):
        """Dense values, lossless: no error feedback around the exchange."""
        ctx.call.n = x.size
        if self.size == 1 or x.size == 0:
            out[...] = x
            return
        ctx.net.allreduce(x, out)

    def reduce_device(self, x, out, backend, state, ctx):
        device_allreduce(x, out, backend, ctx)


def device_allreduce(x, out, backend, ctx) -> None:
    """The dense sum of device arrays ``x`` into ``out``: CUDA-aware MPI reads
    and writes them directly (a device copy on one rank).  ``mpi``'s device
    path, and ``auto``'s when it chooses dense."""
    if ctx.net.size == 1:
        backend.copy(x, out, ctx.where)
        return
    ctx.net.allreduce(x, out, nbytes=ctx.call.nbytes)
