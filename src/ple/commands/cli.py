"""The ``ple`` command: argument parsing, and one convention for results and failures.

Exit status, the same for every subcommand:

- 0: done, and nothing wrong was found;
- 1: the data or the environment has a problem (a damaged or mismatching file, a bad value inside
  a file, a failed check, no GPU for ``--device cuda``, a path that cannot be read or written, a
  full disk: every :class:`~ple.errors.PLEError` and ``OSError``); the reason is one line on
  stderr, or the list of problems found (``inspect``, ``verify``, on stdout);
- 2: the command line itself is wrong: an unknown option, a missing argument, or a value that is
  malformed or out of range, whether argparse sees it (``--ranks 0``) or the command once it has read
  the data the value refers to (``--layer 5`` of a model with two PLE layers, a token id past the
  vocabulary): the command's usage and the error (:class:`~ple.errors.CommandLineError`);
- 129: hung up (SIGHUP: the terminal was closed): the same cleanup as 130;
- 130: interrupted (Ctrl-C); the temporary files being written are removed (table files already
  published stay: each is complete), and so is ``ple demo``'s temporary folder, but for the shards a
  table conversion finished: kept in its ``.partial`` file, which the same command run again continues
  (a line names it, last but one, when it is still there: not in a temporary folder removed since);
- 141: stdout was closed early (``ple ... | head``), quietly;
- 143: terminated (SIGTERM, what ``timeout``, ``kill`` and job runners send): the same cleanup as 130.

Any other exception is a bug in ple and shows its traceback. A ``ple convert`` that fails or is
stopped leaves no folder it made: the output folder (and parents) it created are removed while they
hold no file; a folder that existed before is never removed.

``--json`` always means: print one JSON document on stdout instead of the text report (progress
and log lines go to stderr). Progress bars appear only when stderr is a terminal.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from ple import __version__
from ple.common.files import kept_notes
from ple.errors import CommandLineError, PLEError

__all__ = [
    "COMMANDS",
    "build_parser",
    "main",
    "EXIT_OK",
    "EXIT_PROBLEM",
    "EXIT_USAGE",
    "EXIT_INTERRUPTED",
    "EXIT_PIPE",
    "EXIT_TERMINATED",
    "EXIT_HANGUP",
    "Terminated",
    "HungUp",
]

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_PIPE, EXIT_TERMINATED = 0, 1, 2, 130, 141, 143
EXIT_HANGUP = 129


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is (a KeyboardInterrupt, so whatever cleans up after Ctrl-C
    cleans up after it too)."""


class HungUp(KeyboardInterrupt):
    """SIGHUP (the terminal was closed), raised where the command is, with the cleanup of Ctrl-C."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated()


def _on_sighup(signum, frame) -> None:
    raise HungUp()


_EPILOG = (
    "exit status: 0 ok; 1 a problem with the data or the environment (one line on stderr); "
    "2 a wrong command line (a value out of range included); "
    "129 hung up; 130 interrupted; 141 output closed early; 143 terminated"
)


COMMANDS: tuple[tuple[str, str], ...] = (
    ("inspect", "ple.commands.inspect"),
    ("ids", "ple.commands.ids"),
    ("convert", "ple.commands.convert"),
    ("verify", "ple.commands.verify"),
    ("stats", "ple.commands.stats"),
    ("bench", "ple.commands.bench"),
    ("demo", "ple.commands.demo"),
    ("train", "ple.commands.train"),
    ("eval", "ple.commands.evaluate"),
)
"""The subcommands, in the order ``ple --help`` lists them: (name, module). Each module (or package)
declares the command: ``HELP`` (its one-line help and description), ``add_arguments(parser)`` and
``run(args) -> int`` (the exit status)."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ple", description="PLE layer tools", epilog=_EPILOG)
    ap.add_argument("--version", action="version", version=f"ple {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, path in COMMANDS:
        # imported here, not at the top: ``ple --version`` answers without importing torch
        module = importlib.import_module(path)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP, epilog=_EPILOG)
        # the parser: for the usage of a value refused once the command runs
        p.set_defaults(parser=p, fn=module.run)
        module.add_arguments(p)
    return ap


def _values_may_start_with_dash(argv: list[str]) -> list[str]:
    """``--tokens -5,3`` reads ``-5,3`` as the value (then refused with a clear message), not as an option."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--tokens" and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1][1:2].isdigit():
            out.append(f"--tokens={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ple`` command; returns the exit status (see the module docstring)."""
    argv = _values_may_start_with_dash(list(sys.argv[1:] if argv is None else argv))
    if argv == ["--version"]:  # at once, without building the parser (which imports torch)
        print(f"ple {__version__}")
        return EXIT_OK
    parser = build_parser()
    if not argv:  # bare ``ple``: what it can do, each command with its one line, then the usage error
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's usage, not the top-level one
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    name = f"ple {args.command}"
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig, handler in ((signal.SIGTERM, _on_sigterm), (signal.SIGHUP, _on_sighup)):
            previous[sig] = signal.signal(sig, handler)
    try:
        return int(args.fn(args) or 0)
    except Terminated as e:
        print("\n".join([*kept_notes(e), f"{name}: terminated"]), file=sys.stderr)
        return EXIT_TERMINATED
    except HungUp as e:
        try:  # the terminal may be gone: writing to it can fail
            print("\n".join([*kept_notes(e), f"{name}: hung up"]), file=sys.stderr)
        except OSError:
            pass
        return EXIT_HANGUP
    except KeyboardInterrupt as e:  # what was kept is said only if still there (not in a folder removed since)
        print("\n".join([*kept_notes(e), f"{name}: interrupted"]), file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader went away (``| head``): say nothing more, and keep Python's exit flush quiet
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_PIPE
    except CommandLineError as e:
        print(args.parser.format_usage().rstrip("\n"), file=sys.stderr)
        print(f"{name}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except (PLEError, OSError) as e:
        print(f"{name}: {_one_line(e)}", file=sys.stderr)
        return EXIT_PROBLEM
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _one_line(e: BaseException) -> str:
    """The error as one line: multi-line messages (lists of problems) are joined with '; '."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        text = f"{e.strerror}: {e.filename}"
    else:
        text = str(e) or type(e).__name__
    parts = [re.sub(r"^-\s+", "", p.strip()) for p in text.splitlines()]
    parts = [p for p in parts if p]
    if len(parts) > 1 and parts[0].endswith(":"):
        return parts[0] + " " + "; ".join(parts[1:])
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
