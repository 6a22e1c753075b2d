"""The ``sattn`` command: ``main.py`` parses the command line and dispatches to each experiment's
own command line (``experiments.EXPERIMENTS``: train, sweep, eval, plot), to the benchmarks
(``bench*``; ``common.py`` holds what they share) and to ``describe``."""
