"""structured-attention: structured scoring functions for softmax attention.

- :mod:`structured_attention.matrices` — the MLBTC family of structured matrices;
- :mod:`structured_attention.functional` — attention primitives such as :func:`mlr_attention`;
- :mod:`structured_attention.attention` — attention layers behind one interface and registry.
"""

__version__ = "0.1.0"
