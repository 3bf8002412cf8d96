"""``python -m ple.commands.bench``: see :mod:`ple.commands.bench.runner`."""

from ple.commands.bench.runner import main

raise SystemExit(main())
