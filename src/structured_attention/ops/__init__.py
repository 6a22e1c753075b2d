"""Attention operators, one folder each: the contract, the exact references, the dispatcher and the
backends (PyTorch, C++ and Triton) of one operator live together, and nothing outside ``ops``
is imported by them."""
