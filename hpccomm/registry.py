"""Registries: names to classes, for codecs and for algorithms alike.

A :class:`Registry` holds one kind of plug-in.  Classes register themselves
with the :meth:`Registry.register` decorator under their ``name`` class
attribute; users look them up by name, list them, and ask which options a
class takes (the keyword parameters of its constructor), which is how
:func:`hpccomm.options.resolve_options` routes ``**options``.
"""
from __future__ import annotations

import inspect
from typing import Callable, Dict, FrozenSet, Iterable, Optional, Tuple, Type


class Registry:
    """Named classes of one kind (``"codec"``, ``"algorithm"``).

    ``check(cls, registered)`` may veto a registration by raising
    ``ValueError`` (codecs use it to keep codec ids unique).  ``not_options``
    are constructor parameters that are not user options (e.g. ``comm``)."""

    def __init__(self, kind: str, *, not_options: Iterable[str] = (),
                 check: Optional[Callable[[type, Dict[str, type]], None]] = None):
        self.kind = kind
        self._classes: Dict[str, type] = {}
        self._not_options = frozenset(not_options) | {"self"}
        self._check = check

    def register(self, cls: Type) -> Type:
        """Class decorator: make ``cls`` selectable by ``cls.name``."""
        name = getattr(cls, "name", "")
        if not name or not isinstance(name, str):
            raise ValueError(f"{self.kind} classes need a name")
        other = self._classes.get(name)
        if other is not None and other is not cls:
            raise ValueError(f"{self.kind} name {name!r} is already taken by {other.__qualname__}")
        if self._check is not None:
            self._check(cls, dict(self._classes))
        self._classes[name] = cls
        return cls

    def names(self) -> Tuple[str, ...]:
        """The registered names, sorted."""
        return tuple(sorted(self._classes))

    def get(self, name: str) -> Type:
        """The class registered as ``name`` (``TypeError`` for a non-string,
        ``ValueError`` naming the alternatives for an unknown name)."""
        if not isinstance(name, str):
            raise TypeError(f"{self.kind} must be a name, not {type(name).__name__}")
        cls = self._classes.get(name)
        if cls is None:
            raise ValueError(f"unknown {self.kind} {name!r}; available: {', '.join(self.names())}")
        return cls

    def __contains__(self, name) -> bool:
        return name in self._classes

    def items(self):
        return sorted(self._classes.items())

    def options(self, name_or_cls) -> FrozenSet[str]:
        """The option names a class takes: its constructor's named parameters."""
        cls = self.get(name_or_cls) if isinstance(name_or_cls, str) else name_or_cls
        params = inspect.signature(cls.__init__).parameters.values()
        return frozenset(p.name for p in params
                         if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                         and p.name not in self._not_options)
