"""hpccomm's numba kernels, one module per family (the CPU kernels here, the
``cuda_*`` modules for the device).  ``HPCCOMM_COMPILE_LOCK=1`` makes the
processes that share numba's cache compile each kernel once
(:mod:`.compile_lock`)."""
from . import compile_lock

if compile_lock.requested():
    compile_lock.install()
