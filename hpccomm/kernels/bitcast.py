"""Scalar bit work inside numba kernels: reinterpretation of float32 bits,
and the bit length of an integer (:func:`bit_length`).

``u32_as_f32(u)`` is the float32 whose bit pattern is the low 32 bits of the
integer ``u`` and ``f32_as_u32(f)`` the bit pattern of the float32 ``f`` as a
uint32: an LLVM ``bitcast`` (after a truncation for wider integers, which
numba's arithmetic on uint32 produces), no instruction of its own, so loops
that mix integer work on bit patterns with float arithmetic still vectorize
(a round trip through an array view would not).
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic


@intrinsic
def u32_as_f32(typingctx, u):
    """The float32 with the bit pattern of the low 32 bits of the integer ``u``."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        v = args[0]
        if u.bitwidth > 32:
            v = builder.trunc(v, i32)
        elif u.bitwidth < 32:
            v = builder.zext(v, i32)
        return builder.bitcast(v, ir.FloatType())
    return types.float32(u), codegen


@intrinsic
def f32_as_u32(typingctx, f):
    """The bit pattern (uint32) of the float32 ``f``."""
    if f != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@njit(cache=True, nogil=True, inline="always")
def bit_length(z):
    """Bits of the uint64 ``z`` (``floor(log2 z) + 1``; 0 for 0), by halving."""
    w = 0
    if z >= np.uint64(1 << 32):
        z >>= np.uint64(32)
        w += 32
    if z >= np.uint64(1 << 16):
        z >>= np.uint64(16)
        w += 16
    if z >= np.uint64(1 << 8):
        z >>= np.uint64(8)
        w += 8
    if z >= np.uint64(1 << 4):
        z >>= np.uint64(4)
        w += 4
    if z >= np.uint64(1 << 2):
        z >>= np.uint64(2)
        w += 2
    if z >= np.uint64(2):
        z >>= np.uint64(1)
        w += 1
    return w + np.int64(z)
