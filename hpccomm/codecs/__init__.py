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


def own_algorithm(spec) -> Optional[str]:
    """The algorithm a codec (a name, ``"+rotate"`` names too, or an
    instance) names as its own (``powersgd``'s), or None."""
    if isinstance(spec, Codec):
        return spec.algorithm
    name = split_rotate(spec)[0] if isinstance(spec, str) else None
    return CODECS.get(name).algorithm if name in CODECS else None


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


__all__ = ["Codec", "EncodeContext", "HEADER_SIZE", "available_codecs", "get_codec",
           "own_algorithm", "packet_codecs", "register_codec"]
