"""The ``sattn`` command: ``main.py`` parses and dispatches to one module per experiment (``lm``,
``icl``, ``ts``: train, sweep, eval, plot), to the benchmarks (``bench*``) and to ``describe``;
``common.py`` holds what they share."""
