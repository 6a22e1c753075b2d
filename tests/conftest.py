import os
import warnings

import pytest
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


@pytest.fixture
def no_dynamo_warnings(monkeypatch):
    """Fails the test if torch.compile warns while tracing it (a user compiling a model reads every
    such warning, such as Dynamo's of possible silent incorrectness where it traces through an
    ``lru_cache``). Dynamo warns once per message and process, so its record of the messages it
    gave is emptied for the test."""
    import torch._dynamo.utils as dynamo_utils

    monkeypatch.setattr(dynamo_utils, "warn_once_cache", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    dynamo = [str(w.message).split("\n")[0] for w in caught if "_dynamo" in w.filename]
    assert not dynamo, dynamo
