"""64-bit masks for numba kernels, as intrinsics: built from 64 comparisons
(:func:`outside_closed`, :func:`outside_open`), walked bit by bit
(:func:`lowest_set_bit`), and the extremes of 64 values (:func:`largest64`,
:func:`most_negative64`).

``mask |= uint64(flag_j) << j`` over a chunk of 64 float32 vectorizes, but
as 64-bit lanes: eight vectors of shifts and an or-reduction for one mask.
Written as LLVM IR instead -- one ``<64 x float>`` load, a vector compare and
the ``<64 x i1>`` result bitcast to ``i64`` -- the compare lands in mask
registers where the CPU has them (AVX-512) and in ``movmskps`` elsewhere:
:func:`~hpccomm.kernels.sparsify.adaptive_encode`'s selection took 2.6
against 4.2 ms (16M in columns of 4096 with about 130 candidates each, one
thread).

Walking a mask: ``llvm.cttz`` (one ``tzcnt`` on x86-64, ``rbit`` and ``clz``
on AArch64) in place of a de Bruijn multiply and table lookup took a fifth
more off the same selection (2.1-2.4 against 2.6-3.2 ms).  The chunk
extremes (:func:`largest64`, :func:`most_negative64`) reduce the int32 bits,
a plain integer max, where a float ``fmax`` reduction pays for NaN handling
at every step (half the time).

numba's cache keys a kernel on its own source file only: after editing this
module, remove ``hpccomm/kernels/__pycache__`` so that the kernels using it
compile again.

Bit ``j`` of a mask is element ``start + j`` of the array; NaN sets no bit.
The 64 elements from ``start`` must lie inside the array (no bounds check),
which must be C-contiguous (the typing refuses any other layout).
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: elements per mask
WIDTH = 64


def _outside(strict: bool):
    """An intrinsic ``(arr, start, lo, hi) -> uint64``: bit ``j`` set when
    ``arr[start + j] >= hi or arr[start + j] <= lo`` (``>`` / ``<`` with
    ``strict``); ``lo`` and ``hi`` are float32."""
    upper, lower = (">", "<") if strict else (">=", "<=")

    def typer(typingctx, arr, start, lo, hi):
        if not (_chunk_source(arr, start) and lo == types.float32 and hi == types.float32):
            return None

        def codegen(context, builder, sig, args):
            vec = ir.VectorType(ir.FloatType(), WIDTH)
            values = _load(context, builder, sig, args, vec)
            above = builder.fcmp_ordered(upper, values, _splat(builder, args[3], vec))
            below = builder.fcmp_ordered(lower, values, _splat(builder, args[2], vec))
            return builder.bitcast(builder.or_(above, below), ir.IntType(WIDTH))

        return types.uint64(arr, start, lo, hi), codegen

    typer.__name__ = "outside_open" if strict else "outside_closed"
    return intrinsic(typer)


def _chunk_source(arr, start) -> bool:
    """Whether numba types ``(arr, start)`` are a C-contiguous 1-D float32
    array and an integer, the only operands the intrinsics read from."""
    return (isinstance(arr, types.Array) and arr.ndim == 1 and arr.layout == "C"
            and arr.dtype == types.float32 and isinstance(start, types.Integer))


def _load(context, builder, sig, args, vec):
    """The 64 elements from ``arr[start]`` (``args[:2]``) as one vector of
    type ``vec`` (4-byte aligned)."""
    ary = context.make_array(sig.args[0])(context, builder, args[0])
    ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]],
                                   wraparound=False)
    return builder.load(builder.bitcast(ptr, vec.as_pointer()), align=4)


def _splat(builder, scalar, vec):
    """``scalar`` in every lane of a vector of type ``vec``."""
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), scalar, ir.IntType(32)(0))
    lanes = ir.VectorType(ir.IntType(32), vec.count)
    return builder.shuffle_vector(one, one, ir.Constant(lanes, [0] * vec.count))


#: ``outside_closed(arr, start, lo, hi)``: bit ``j`` when ``arr[start + j]``
#: is ``>= hi`` or ``<= lo``
outside_closed = _outside(strict=False)
#: ``outside_open(arr, start, lo, hi)``: bit ``j`` when ``arr[start + j]``
#: is ``> hi`` or ``< lo``
outside_open = _outside(strict=True)


@intrinsic
def lowest_set_bit(typingctx, mask):
    """The position (int64) of the lowest set bit of the non-zero uint64
    ``mask`` (``llvm.cttz``; undefined for 0)."""
    if mask != types.uint64:
        return None

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i64, [i64, ir.IntType(1)]), "llvm.cttz.i64")
        return builder.call(fn, [args[0], ir.IntType(1)(1)])

    return types.int64(mask), codegen


def _extreme(reduction: str):
    """An intrinsic ``(arr, start) -> float32``: the element among the 64
    float32 from ``arr[start]`` whose bits are the largest as int32
    (``smax``) or uint32 (``umax``), by ``llvm.vector.reduce``."""

    def typer(typingctx, arr, start):
        if not _chunk_source(arr, start):
            return None

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            vec = ir.VectorType(i32, WIDTH)
            bits = _load(context, builder, sig, args, vec)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(i32, [vec]),
                f"llvm.vector.reduce.{reduction}.v{WIDTH}i32")
            return builder.bitcast(builder.call(fn, [bits]), ir.FloatType())

        return types.float32(arr, start), codegen

    typer.__name__ = "largest64" if reduction == "smax" else "most_negative64"
    return intrinsic(typer)


#: ``largest64(arr, start)``: of the 64 float32 from ``arr[start]``, the
#: largest when one is positive (positive floats order as their int32 bits; a
#: positive NaN beats them all), else a value that is not ``> 0`` (zero, a
#: negative value or a negative NaN)
largest64 = _extreme("smax")
#: ``most_negative64(arr, start)``: of the 64 float32 from ``arr[start]``, the
#: most negative when one is negative (a negative float's uint32 bits beat
#: every positive's and grow with its magnitude; a negative NaN beats them
#: all), else a value that is not ``< 0``
most_negative64 = _extreme("umax")
