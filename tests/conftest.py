import os

import torch

# Without a GPU, Triton kernels are tested in Triton's interpreter; it must be chosen before
# Triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist's workers share the cores, so each takes its share of torch's threads: with more
# threads than cores, every parallel region waits for threads that are not running (with two
# workers of two threads on two cores, the coordinate-check test of many small steps took 103 s
# instead of 6). Subprocesses inherit the share through OMP_NUM_THREADS.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _share = max(1, torch.get_num_threads() // _workers)
    torch.set_num_threads(_share)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
