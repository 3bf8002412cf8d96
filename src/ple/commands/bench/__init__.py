"""Benchmarks of the PLE layer against transformers' ``qwen4_exp`` module, measured side by side.

One runner (:mod:`ple.commands.bench.runner`) over a registry of named cases (:mod:`ple.commands.bench.cases`):
``ids``, ``prefill-*``, ``decode-*``, ``mixed-*``. Every case checks ple's output against
transformers' before anything is timed and is refused (no timings reported) when the check fails.
Each case reports the median time of ple, of transformers and of the arithmetic floor (the two
projections alone on the same rows), their ratios, and whether the case's targets are met.

Run it with ``python -m ple.commands.bench`` (``--help`` for the options), or from code::

    from ple.commands.bench import runner
    parser = argparse.ArgumentParser(); runner.add_arguments(parser)
    runner.run(parser.parse_args(["--quick", "--cases", "ids"]))
"""

from ple.commands.bench.cases import CASES, PUBLISHED, QUICK, Geometry
from ple.commands.bench.runner import add_arguments, main, run

__all__ = ["CASES", "HELP", "Geometry", "PUBLISHED", "QUICK", "add_arguments", "main", "run"]

HELP = "benchmarks against transformers, side by side"
