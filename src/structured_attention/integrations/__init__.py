"""Integrations with other libraries, each imported only when used:

- :mod:`structured_attention.integrations.transformers`: MLR attention inside Hugging Face
  transformers models (the ``[hf]`` extra).
"""
