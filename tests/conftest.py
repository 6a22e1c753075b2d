import os

import torch

# Without a GPU, Triton kernels are tested in Triton's interpreter; it must be chosen before
# Triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
