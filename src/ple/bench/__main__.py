"""``python -m ple.bench``: see :mod:`ple.bench.runner`."""

from .runner import main

raise SystemExit(main())
