"""Integrations of ple into other libraries and runtimes, one module each.

For example :mod:`ple.integrations.transformers` swaps the PLE modules of a transformers
``qwen4_exp`` model for ple-backed ones (any table tier) while ``generate()`` keeps using
transformers' own cache. Importing this package imports no third-party library; each integration
imports its library itself.
"""

__all__: list[str] = []
