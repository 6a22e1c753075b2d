"""Models built from the attention layers."""

from .gpt import GPT, Block, GPTConfig

__all__ = ["GPT", "Block", "GPTConfig"]
