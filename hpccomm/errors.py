"""Exceptions raised by hpccomm.

Every error that one rank detects is raised on *every* rank of the
communicator (see :mod:`hpccomm.validation`), with the same class and a message
that names the rank where it started.  The classes below subclass the built-in
exception a user would expect (``ValueError`` / ``TypeError``) so that
``except ValueError`` keeps working.
"""


class HpccommError(Exception):
    """Base class of the errors that hpccomm defines itself."""


class ConsistencyError(HpccommError, ValueError):
    """The ranks called the same collective with different arguments
    (length, dtype, codec, algorithm, op, ...)."""


class PacketError(HpccommError, ValueError):
    """A packet handed to a decoder is truncated, oversized or corrupt."""


class NonFiniteError(HpccommError, ValueError):
    """The input holds NaN or Inf and the policy is ``nonfinite="raise"``."""


def nonfinite_input(count: int, codec: str) -> NonFiniteError:
    """The error for ``count`` NaN/Inf values in a reducer's input."""
    return NonFiniteError(f"input holds {count} NaN/Inf value(s); codec {codec!r} has "
                          "nonfinite='raise'")


class RemoteError(HpccommError):
    """An error of a class hpccomm cannot rebuild, raised on another rank."""
