"""``ple demo``: an end-to-end run on an embedded default (or a real checkpoint); see :mod:`.serving`."""

from .serving import DEMO_CONFIG, add_arguments, run, serve, synthesize_checkpoint

__all__ = ["DEMO_CONFIG", "add_arguments", "run", "serve", "synthesize_checkpoint"]
