"""Codecs: how one rank's vector becomes bytes and back.  See :mod:`.base`.

:func:`get_codec` lives here, above every codec module, because a name may
ask for the rotation of :mod:`.rotation`, which is itself a codec.
"""
import importlib
import pkgutil
from typing import Optional

from .base import (CODECS, HEADER_SIZE, Codec, EncodeContext,  # noqa: F401
                   available_codecs, packet_codecs, register_codec)
from .rotation import rotated, split_rotate

# Every module of the package is imported, and each registers its codec(s):
# adding a codec is adding a file.
for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_mod}")


def _codec_or_class(spec):
    """The codec instance ``spec``, or the registered class its name (``"+rotate"``
    names too) names, or None: what the class attributes are read from."""
    if isinstance(spec, Codec):
        return spec
    name = split_rotate(spec)[0] if isinstance(spec, str) else None
    return CODECS.get(name) if name in CODECS else None


def own_algorithm(spec) -> Optional[str]:
    """The algorithm a codec (a name, ``"+rotate"`` names too, or an
    instance) names as its own (``powersgd``'s), or None."""
    codec = _codec_or_class(spec)
    return None if codec is None else codec.algorithm


def default_algorithm(spec) -> str:
    """The algorithm a call with this codec takes when it names none: the
    codec's own (``powersgd``), ``"mpi"`` for the lossless ``none`` (dense
    values, ``MPI_Allreduce``), and ``"twoshot"`` for every codec that sends
    packets (the quantizers and the sparsifiers).  ``"auto"`` is not the
    default: on a link where compression does not pay it chooses dense, but its
    model ranks the compressed algorithms within its own error of each other
    (docs/results/auto.md)."""
    codec = _codec_or_class(spec)
    if codec is None:           # an unknown name: get_codec raises its error
        return "mpi"
    return codec.algorithm or ("mpi" if codec.lossless else "twoshot")


def get_codec(spec, **params) -> Codec:
    """A codec instance from a name (with ``params``) or an instance.

    Every name takes the options ``rotate`` (default False) and
    ``rotate_block``: ``rotate=True`` -- or the name with ``"+rotate"``
    appended -- returns the codec wrapped in the randomized Hadamard rotation
    of :mod:`hpccomm.codecs.rotation` (dense lossy quantizers only)."""
    if isinstance(spec, Codec):
        if params:
            raise TypeError("pass codec parameters only with a codec name")
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"codec must be a name or a Codec, not {type(spec).__name__}")
    name, suffixed = split_rotate(spec)
    rotate = params.pop("rotate", None)
    block = params.pop("rotate_block", None)
    if suffixed:
        if rotate is not None and rotate is not True:
            raise ValueError(f"codec {spec!r} with rotate={rotate!r}: the name asks for "
                             "rotate=True")
        rotate = True
    codec = CODECS.get(name)(**params)
    if rotate is None and block is None:
        return codec
    return rotated(codec, False if rotate is None else rotate, block)


__all__ = ["Codec", "EncodeContext", "HEADER_SIZE", "available_codecs", "default_algorithm",
           "get_codec", "own_algorithm", "packet_codecs", "register_codec"]
