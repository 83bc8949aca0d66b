"""Device twins of the codecs (numba.cuda kernels, the same packets): see
:mod:`hpccomm.device_codecs.base`.  Imports numba.cuda."""
from .base import (DeviceCodec, device_codec_class, device_codec_for, device_codec_names,
                   register_device_codec)

__all__ = ["DeviceCodec", "device_codec_class", "device_codec_for", "device_codec_names",
           "register_device_codec"]
