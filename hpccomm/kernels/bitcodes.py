"""``b``-bit two's complement codes, the packets' payload of TernGrad
(``b = 2``) and QSGD (``b`` in 2, 4, 8): packing, unpacking, decoding.

* codes are two's complement, packed LSB first: element ``i`` takes bits
  ``(i b) mod 8 ..`` of byte ``(i b) // 8``;
* a code ``q`` with scale ``S`` and ``L`` levels decodes to
  ``float32(q * (float64(S) / L))``.

:mod:`hpccomm.kernels.cuda_quantize` decodes them the same way on a GPU.
"""
import numpy as np
from numba import njit

from .quant_common import BLOCK


@njit(cache=True, nogil=True, inline="always")
def _pack_block(codes, m, bits, packed, first):
    """Pack ``codes[0:m]`` (an int8 scratch of :data:`BLOCK` codes, two's
    complement) into ``packed`` from byte ``first`` on; element 0 starts a
    byte.  Whole bytes are built from uint32 / uint16 views of the scratch
    (little-endian: code ``k`` of a word sits in its byte ``k``)."""
    full = (m * bits) >> 3
    dst = packed[first:first + full]
    if bits == 2:
        quads = codes.view(np.uint32)
        for j in range(full):
            w = quads[j]
            dst[j] = (w & 0x3) | ((w >> 6) & 0xC) | ((w >> 12) & 0x30) | ((w >> 18) & 0xC0)
    elif bits == 4:
        pairs = codes.view(np.uint16)
        for j in range(full):
            w = pairs[j]
            dst[j] = (w & 0xF) | ((w >> 4) & 0xF0)
    else:
        raw = codes.view(np.uint8)
        for j in range(full):
            dst[j] = raw[j]
    per = 8 // bits
    if full * per < m:
        byte = np.int64(0)
        for k in range(m - full * per):
            byte |= (np.int64(codes[full * per + k]) & ((1 << bits) - 1)) << (k * bits)
        packed[first + full] = byte


_SPLAT2 = np.uint32(0x02020202)
_SPLAT_7E = np.uint32(0x7E7E7E7E)
_SPLAT_80 = np.uint32(0x80808080)


@njit(cache=True, nogil=True, inline="always")
def _unpack_block(packed, first, m, bits, codes):
    """Sign-extend ``m`` packed ``bits``-bit codes (the first one at byte
    ``first`` of ``packed``) into the int8 scratch ``codes`` (a multiple of
    4 long; up to 3 entries past ``m`` are written).  Each packed byte is
    spread into a uint16 / uint32 word of the scratch, one code per byte
    (little-endian), and sign-extended in all bytes at once: with ``y = c ^
    h`` (``h = 2**(bits - 1)``) in every byte, ``(y + 0x80 - h) ^ 0x80`` is
    ``y - h`` modulo 256 and never carries into the next byte."""
    src = packed[first:first + ((m * bits + 7) >> 3)]
    if bits == 2:
        quads = codes.view(np.uint32)
        for j in range(src.size):
            b = np.uint32(src[j])
            w = (b & np.uint32(0x03)) | ((b & np.uint32(0x0C)) << np.uint32(6)) \
                | ((b & np.uint32(0x30)) << np.uint32(12)) \
                | ((b & np.uint32(0xC0)) << np.uint32(18))
            quads[j] = ((w ^ _SPLAT2) + _SPLAT_7E) ^ _SPLAT_80
    elif bits == 4:
        pairs = codes.view(np.uint16)
        for j in range(src.size):
            b = np.uint16(src[j])
            w = (b & np.uint16(0x0F)) | ((b & np.uint16(0xF0)) << np.uint16(4))
            pairs[j] = ((w ^ np.uint16(0x0808)) + np.uint16(0x7878)) ^ np.uint16(0x8080)
    else:
        raw = codes.view(np.uint8)
        for j in range(src.size):
            raw[j] = src[j]


@njit(cache=True, nogil=True, inline="always")
def _scale_codes(codes, unit, out, add):
    if add:
        for k in range(out.size):
            out[k] += np.float32(codes[k] * unit)
    else:
        for k in range(out.size):
            out[k] = np.float32(codes[k] * unit)


@njit(cache=True, nogil=True, inline="always")
def _decode_range(packed, bits, bucket, levels, scales, lo, hi, codes, ob, add):
    """Elements ``lo .. hi - 1`` of a packet's codes (``lo`` starts a byte),
    decoded into ``ob`` (``hi - lo`` long; ``add``: ``ob +=``) through the int8
    scratch ``codes``: one bucket's piece at a time."""
    _unpack_block(packed, (lo * bits) >> 3, hi - lo, bits, codes)
    i = lo
    while i < hi:
        j = i // bucket
        seg = min((j + 1) * bucket, hi)
        _scale_codes(codes[i - lo:seg - lo], np.float64(scales[j]) / levels,
                     ob[i - lo:seg - lo], add)
        i = seg


@njit(cache=True, nogil=True)
def codes_decode(packed, bits, bucket, levels, scales, out, add):
    """Dense values of packed ``bits``-bit codes: element ``i`` of bucket
    ``j = i // bucket`` decodes to ``float32(q_i * (float64(scales[j]) / levels))``;
    ``add``: ``out +=``."""
    n = out.size
    codes = np.empty(BLOCK, dtype=np.int8)
    for blo in range(0, n, BLOCK):
        bhi = min(blo + BLOCK, n)
        _decode_range(packed, bits, bucket, levels, scales, blo, bhi, codes, out[blo:bhi],
                      add)


@njit(cache=True, nogil=True, inline="always")
def _decode_sum_range(rcodes, bits, bucket, levels, rscales, lo, hi, codes, ab):
    """``ab = 0 + decode(packet 0) + decode(packet 1) + ...`` over elements
    ``lo .. hi - 1``, in packet order: the bits of zeroing and adding each
    packet with :func:`codes_decode`.  Row ``src`` of ``rcodes`` / ``rscales``
    holds packet ``src``'s codes / scales."""
    for k in range(ab.size):
        ab[k] = 0.0
    for src in range(rcodes.shape[0]):
        _decode_range(rcodes[src], bits, bucket, levels, rscales[src], lo, hi, codes, ab, True)


@njit(cache=True, nogil=True)
def summed_decode(total, bucket, levels, scales, out, add):
    """Like :func:`codes_decode` for unpacked integer codes (or sums of them)."""
    n = out.size
    for j in range(scales.size):
        lo = j * bucket
        hi = min(lo + bucket, n)
        _scale_codes(total[lo:hi], np.float64(scales[j]) / levels, out[lo:hi], add)
