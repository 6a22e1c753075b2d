"""A long run: memory stays flat after warm-up, and getting batches never holds training up for
as long as a step. Both come from what the training loop itself logs in metrics.jsonl
(``rss_mib``, and ``data_s`` / ``step_s`` per logging window)."""

from __future__ import annotations

import json
import statistics

import torch

from structured_attention.experiments.lm import load_lm_config, train_lm
from test_training import tiny_overrides


def test_memory_is_flat_over_1000_steps_and_data_never_blocks(tmp_path):
    # the process's own memory and the host's data path: on the CPU (a GPU's driver grows the
    # process's memory as it loads kernels, and its steps are shorter than any host work)
    cfg = load_lm_config(None, tiny_overrides(tmp_path, steps=1000, log_every=10, eval_every=500, checkpoint_every=250,
                                              sample_tokens=0, device="cpu"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest, and steady on a shared machine
    try:
        train_lm(cfg)
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(10, 1001, 10))
    after_warmup = [r["rss_mib"] for r in rows if r["step"] >= 50]
    growth = max(after_warmup) - after_warmup[0]
    assert growth < 8, f"resident memory grew {growth:.1f} MiB between step 50 and step 1000"
    # The whole window's wait for batches, per step, stays far below one step's time.
    step_s = statistics.median(r["step_s"] for r in rows)
    assert max(r["data_s"] for r in rows) < step_s, (max(r["data_s"] for r in rows), step_s)
