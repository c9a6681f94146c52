"""Target rank 0's held-out capture in training batches holds a batch's peak, and the memory model predicts
that peak (`benchmarks/heldout_capture.py` at a small size: torch's allocation events, deterministic)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.heldout_capture import measure
from dflash_ops.training import memory_fit


@pytest.mark.parametrize("intermediate", [256, 384])  # an MLP of 2H and one of 3H (Qwen3's)
def test_the_held_out_capture_in_batches_holds_a_batch_and_the_model_predicts_it(intermediate):
    args = argparse.Namespace(layers=4, hidden=128, intermediate=intermediate, heads=4, vocab=256, k=2,
                              rows=16, max_len=128, batch=4)
    row = measure(args)
    whole, batched, by_row = (row["paths"][name] for name in
                              ("all at once", "in batches", "in batches, 1 row a pass"))
    assert batched["peak_mib"] < 0.3 * whole["peak_mib"]  # 4 batches of 4 rows, not 16 rows at once
    assert by_row["peak_mib"] < batched["peak_mib"]
    for path in (whole, batched, by_row):
        assert 0.95 < path["measured_over_predicted"] < 1.12, row
    expected = memory_fit.capture_working_elements(memory_fit.TargetShape(4, 128, intermediate, 4, 2, 32, 256,
                                                                          tied=False))
    assert batched["working_elements"] == pytest.approx(expected, rel=0.05), row
