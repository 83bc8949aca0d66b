"""Codecs: how one rank's vector becomes bytes and back.  See :mod:`.base`."""
from .base import (HEADER_SIZE, Codec, EncodeContext, available_codecs, get_codec,  # noqa: F401
                   register_codec)
from . import none  # noqa: F401  (registers)

__all__ = ["Codec", "EncodeContext", "HEADER_SIZE", "available_codecs", "get_codec",
           "register_codec"]
