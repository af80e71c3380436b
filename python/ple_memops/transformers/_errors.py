"""Typed errors of the transformers integration (all are :class:`~ple_memops.PleMemopsError`)."""

from __future__ import annotations

from ..errors import InvalidArgumentError, TableError


class UnsupportedModelError(InvalidArgumentError):
    """The model is not one this integration can serve (not Gemma 3n or Qwen4Exp, or a
    layout it does not know); the message names the class and what is supported."""


class TableMissingError(TableError):
    """The checkpoint has no tensor for one of the model's PLE tables; the message names
    the names looked for and the checkpoint."""


class TableMismatchError(TableError):
    """The checkpoint's table disagrees with the model: dtype, width or row count."""
