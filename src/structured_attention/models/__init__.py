"""Models built from the attention layers: the shared backbone and the models that wrap it."""

from .gpt import GPT, GPTConfig
from .protocol import TrainableModel
from .transformer import Block, Transformer, TransformerConfig, parameter_fans

__all__ = ["GPT", "Block", "GPTConfig", "Transformer", "TrainableModel", "TransformerConfig", "parameter_fans"]
