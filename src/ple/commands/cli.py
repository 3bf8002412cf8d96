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


def build_parser() -> argparse.ArgumentParser:
    # imported here, not at the top: ``ple --version`` answers without importing torch
    from ple.commands import demo
    from ple.commands import tables as commands
    from ple.commands.bench import runner
    from ple.common import argtypes
    from ple.data.tokens import add_token_arguments
    from ple.table.formats.catalog import accepted_names, format_argument

    ap = argparse.ArgumentParser(prog="ple", description="PLE layer tools", epilog=_EPILOG)
    ap.add_argument("--version", action="version", version=f"ple {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, epilog=_EPILOG)
        p.set_defaults(parser=p)  # for the usage of a value refused once the command runs
        return p

    json_help = "print one JSON document on stdout instead of the text report"

    p = add(
        "inspect",
        "what a path is and holds: layout per PLE layer; for a checkpoint, a check of its headers and small "
        "tensors; for a training checkpoint, its trained rows; for a GGUF model, its PLE metadata and table "
        "tensor; for a table file, its header and what it was made from; for a table folder, its table files; "
        "for an adapter, its layers",
    )
    p.add_argument(
        "path",
        help="config.json, model directory (a Trainer checkpoint-N folder too), model.safetensors.index.json, a "
        "GGUF file (model.gguf, or any part of a -0000k-of-0000N.gguf split set), a .pletable table file, a "
        "folder of table files or an adapter file",
    )
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(fn=commands.inspect)

    p = add("ids", "the table rows each token of a fresh request reads")
    p.add_argument("path", help="config.json or model directory")
    p.add_argument("--tokens", required=True, help="token ids separated by commas or spaces, e.g. 3,17,248044,9")
    p.add_argument(
        "--layer", type=argtypes.integer, default=0, help="PLE layer index: position in ple_layer_ids (default 0)"
    )
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(fn=commands.ids)

    p = add(
        "convert",
        "write each PLE layer's table as one memory-mappable table file (from a checkpoint, or from a GGUF "
        "model's PLE table, its blocks copied)",
    )
    p.add_argument(
        "checkpoint",
        help="model directory (config.json + safetensors), index file, or a qwen4exp GGUF file (model.gguf, or "
        "any part of a -0000k-of-0000N.gguf split set)",
    )
    p.add_argument("out", help="output folder (one <prefix>.pletable file per PLE layer)")
    p.add_argument(
        "--to",
        type=format_argument,
        metavar="FORMAT",
        help=f"the format to write: {accepted_names()}. fp8_row/int8_row (int8): one scale per row; fp8: the "
        "source copied when it is fp8 already, else fp8_row; bf16/fp16/fp32: the values cast; q8_0 q5_1 q5_0 q4_1 "
        "q4_0 iq4_nl mxfp4 (GGML blocks of 32) or nvfp4 (blocks of 16, E4M3 scales): block formats. The format the "
        "source already has is copied exactly",
    )
    p.add_argument("--layers", help="PLE layer indexes (positions in ple_layer_ids), e.g. 0,1 (default: all)")
    p.add_argument("--force", action="store_true", help="replace existing table files")
    p.add_argument(
        "--config",
        help="config.json (default: the checkpoint's; for a GGUF, the config whose layout the table file "
        "carries, every PLE key of the GGUF checked against it; without it the GGUF's PLE keys are the layout)",
    )
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(fn=commands.convert)

    p = add(
        "verify",
        "recompute table files' checksums (and compare each with its checkpoint); exit 1 if any has a problem",
    )
    p.add_argument(
        "files",
        nargs="+",
        metavar="file",
        help="one or more .pletable files or folders of them (with --json: one file's {file, ok, problems}; "
        "for several, {ok, files: [...]})",
    )
    p.add_argument(
        "--checkpoint", help="the model directory they were converted from (each file matched to its PLE layer)"
    )
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(fn=commands.verify)

    p = add("stats", "row traffic of a token stream: distinct rows, reuse per step/request, cache hit rates")
    p.add_argument("path", help="config.json or model directory")
    add_token_arguments(p)
    p.add_argument("--batch", type=argtypes.positive_int, default=64, help="requests decoded side by side (64)")
    p.add_argument("--request-tokens", type=argtypes.positive_int, default=256, help="tokens per request (256)")
    p.add_argument(
        "--cache-rows",
        type=argtypes.positive_int,
        nargs="+",
        default=[1 << 16, 1 << 20],
        help="sizes of the LRU row caches to simulate (65536 1048576)",
    )
    p.add_argument("--layer", type=argtypes.integer, default=0, help="PLE layer index (default 0)")
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(fn=commands.stats)

    p = add("bench", "benchmarks against transformers, side by side")
    runner.add_arguments(p)
    p.set_defaults(fn=runner.run)

    p = add("demo", "end-to-end run: synthesize, load, serve, check against the reference")
    demo.add_arguments(p)
    p.set_defaults(fn=demo.run)

    from ple.commands import train as finetune

    p = add("train", "fine-tune a model's PLE tables from disk on real text, with its loss curve; merge adapters")
    finetune.add_arguments(p)
    p.set_defaults(fn=finetune.run)

    from ple.commands import evaluate

    p = add("eval", "what a table format or an adapter costs in quality: perplexity and KL divergence, side by side")
    evaluate.add_arguments(p)
    p.set_defaults(fn=evaluate.run)
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
    args, unknown = build_parser().parse_known_args(argv)
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
