"""Codecs: how one rank's vector becomes bytes and back.  See :mod:`.base`."""
import importlib

from .base import (HEADER_SIZE, Codec, EncodeContext, available_codecs, get_codec,  # noqa: F401
                   register_codec)

# Each module registers its codec(s) on import.
_QUANTIZERS = ("none", "fp16", "bf16", "onebit", "terngrad", "qsgd")
_SPARSIFIERS = ("threshold", "adaptive", "topk", "randk", "dgc")

for _name in _QUANTIZERS + _SPARSIFIERS:
    importlib.import_module(f"{__name__}.{_name}")

__all__ = ["Codec", "EncodeContext", "HEADER_SIZE", "available_codecs", "get_codec",
           "register_codec"]
