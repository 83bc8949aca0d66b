"""Routing ``**options`` to a codec and an algorithm.

Every entry point takes the parameters of the codec and of the algorithm as
one flat set of keyword options (``Allreducer(codec="topk",
algorithm="kylix", ratio=0.01, degrees=(2, 2))``); :func:`resolve_options`
sends each to the constructor that declares it.  :class:`~hpccomm.Allreducer`,
:func:`~hpccomm.sparse_allreduce` and every benchmark command use it, so an
option means the same thing everywhere and an unknown one gets the same
message everywhere.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

from .codecs.base import CODECS, Codec
from .codecs.rotation import ROTATE_OPTIONS, split_rotate
from .collectives.base import ALGORITHMS


def option_names(codec: Any = None, algorithm: Optional[str] = None) -> Tuple[frozenset, frozenset]:
    """``(codec options, algorithm options)``: the parameter names the named
    codec and algorithm take (empty for ``None``, an unknown name or a codec
    instance, which takes no options)."""
    name = split_rotate(codec)[0] if isinstance(codec, str) else None
    c = CODECS.options(name) | ROTATE_OPTIONS if name in CODECS else frozenset()
    a = (ALGORITHMS.options(algorithm) if isinstance(algorithm, str) and algorithm in ALGORITHMS
         else frozenset())
    return c, a


def resolve_options(codec: Any, algorithm: Optional[str], options: Mapping[str, Any], *,
                    strict: bool = True) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Split ``options`` into ``(codec_options, algorithm_options)`` by name.

    ``codec`` is a registered codec name, a :class:`~hpccomm.codecs.Codec`
    instance or ``None``; ``algorithm`` a registered algorithm name or
    ``None``.  A key may be scoped, ``"CODEC.name"`` or ``"ALGORITHM.name"``:
    it then applies only when that codec or algorithm is the one named.

    With ``strict`` (the default) a name that neither takes raises
    ``TypeError`` naming the options each does take; otherwise it is left
    out (the benchmark applies one option set to many cases).  A name both
    take raises ``TypeError`` unless it is scoped.
    """
    codec_name = codec.name if isinstance(codec, Codec) else codec
    takes_c, takes_a = option_names(codec, algorithm)
    # "qsgd.bits" applies to "qsgd+rotate" too (and to a rotated instance)
    base_name = split_rotate(codec_name)[0] if isinstance(codec_name, str) else codec_name
    codec_opts: Dict[str, Any] = {}
    alg_opts: Dict[str, Any] = {}
    for key, value in options.items():
        if not isinstance(key, str):
            raise TypeError(f"option names are strings, not {type(key).__name__}")
        scope, _, name = key.rpartition(".")
        if scope and scope not in (codec_name, algorithm, base_name):
            if strict:
                raise TypeError(f"option {key!r} is scoped to {scope!r}, which is neither the "
                                f"codec {codec_name!r} nor the algorithm {algorithm!r}")
            continue
        to_codec = name in takes_c and scope in ("", codec_name, base_name)
        to_alg = name in takes_a and scope in ("", algorithm)
        if to_codec and to_alg:
            raise TypeError(f"option {name!r} is taken by both codec {codec_name!r} and "
                            f"algorithm {algorithm!r}: pass it as '{codec_name}.{name}' or "
                            f"'{algorithm}.{name}'")
        if to_codec:
            codec_opts[name] = value
        elif to_alg:
            alg_opts[name] = value
        elif strict:
            raise TypeError(f"unknown option {name!r} for {_describe(codec_name, algorithm)} "
                            f"({_takes(codec_name, takes_c, algorithm, takes_a)})")
    return codec_opts, alg_opts


def _describe(codec, algorithm) -> str:
    parts = []
    if codec is not None:
        parts.append(f"codec {codec!r}")
    if algorithm is not None:
        parts.append(f"algorithm {algorithm!r}")
    return " and ".join(parts) or "no codec or algorithm"


def _takes(codec, takes_c, algorithm, takes_a) -> str:
    parts = []
    for kind, name, names in (("codec", codec, takes_c), ("algorithm", algorithm, takes_a)):
        if name is not None:
            parts.append(f"{kind} {name!r} takes " + (", ".join(sorted(names)) or "no options"))
    return "; ".join(parts)
