"""The exceptions ple raises on purpose: one base, :class:`PLEError`, so callers (and the ``ple``
command) can tell a refused input from a bug.

Every class also derives from the built-in exception it refines (``ValueError``, ``TypeError``,
``IndexError``, ``RuntimeError``), so ``except ValueError`` keeps working. The specific errors live
beside the code that raises them (``ConfigError`` in :mod:`ple.config`, ``TableFileError`` in
:mod:`ple.table.files.table_file`, ...) and derive from one of these.
"""

from __future__ import annotations

__all__ = ["PLEError", "InvalidArgumentError", "ArgumentTypeError", "UsageError", "CommandLineError"]


class PLEError(Exception):
    """Base of every exception ple raises on purpose; the message names the value and what was expected."""


class InvalidArgumentError(PLEError, ValueError):
    """An argument has a value ple cannot use (a shape, a range, a format name, a geometry)."""


class ArgumentTypeError(PLEError, TypeError):
    """An argument has a type ple cannot use."""


class UsageError(PLEError, RuntimeError):
    """An object was used in a state that does not allow the call (a closed table, a layer without a
    table, a handle already released)."""


class CommandLineError(InvalidArgumentError):
    """A value given on the ``ple`` command line that the command cannot use, found once it has read
    what the value refers to (a PLE layer index the config does not have, a token id past the
    vocabulary, options that do not fit together): exit status 2 with the command's usage, like the
    values argparse refuses itself."""
