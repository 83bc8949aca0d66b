"""Codecs: how one rank's vector becomes bytes and back.  See :mod:`.base`."""
import importlib
import pkgutil

from .base import (HEADER_SIZE, Codec, EncodeContext, available_codecs, get_codec,  # noqa: F401
                   packet_codecs, register_codec)

# Every module of the package is imported, and each registers its codec(s):
# adding a codec is adding a file.
for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_mod}")

__all__ = ["Codec", "EncodeContext", "HEADER_SIZE", "available_codecs", "get_codec",
           "packet_codecs", "register_codec"]
