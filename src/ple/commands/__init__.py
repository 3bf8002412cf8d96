"""The ``ple`` command: the parser and exit conventions (:mod:`ple.commands.cli`) and one module or
package per subcommand, each with its ``HELP``, ``add_arguments`` and ``run`` (:mod:`.inspect`,
:mod:`.ids`, :mod:`.convert`, :mod:`.verify`, :mod:`.stats`, :mod:`.evaluate` for ``ple eval``, and the
packages ``train``, ``demo`` and ``bench``); :mod:`ple.commands.report` holds what several of them share."""
