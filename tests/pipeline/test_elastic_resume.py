"""Elastic resume: a pipeline run resumed with another number of drafter workers goes on at exactly the
next untrained batch of its seeded data order, and an optim.epochs run trains each batch of its epochs
once, whatever the worker counts before and after (docs/CONTRACTS.md, "Resume")."""

from __future__ import annotations

from collections import Counter

import pytest

from dflash_ops.training.checkpoint import latest_checkpoint, load_checkpoint

ROWS = 24  # 2 epochs of 24 rows at batch 4: 12 batches
EPOCHS = {"total_steps": None, "epochs": 2.0}


def layout(drafters: int) -> dict:
    return {"device": "cpu", "target_workers": 1, "drafter_workers": drafters, "threads_per_worker": 1,
            "queue_depth": 2}


def trained_batches(events: list[dict]) -> list[int]:
    """The batch indices the run's step lines say their steps trained ([first, end) each)."""
    return [i for e in events if e["event"] == "step" for i in range(*e["batches"])]


def finish(run, timeout: float = 240) -> list[dict]:
    assert run.wait(timeout=timeout) == 0, run.log_path.read_text()[-3000:]
    return run.events()


@pytest.mark.slow
def test_two_then_one_then_three_drafters_train_each_batch_of_the_epochs_once(
        write_config, start_run, demo_dir, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join((demo_dir / "data" / "train.jsonl").read_text().splitlines(True)[:ROWS]))
    sections = {"data": {"path": str(data), "eval_path": None}, "optim": EPOCHS}
    single = finish(start_run(write_config("single", **sections)))
    expected = trained_batches(single)
    assert expected == list(range(12))  # one drafter, 12 steps of one batch

    # 2 drafters for 2 steps (batches 0-3), 1 drafter for 2 (4, 5), then 3 drafters to the end of the
    # epochs: the 6 batches left, 2 steps of 3 (not the 4 steps 2 epochs derive for 3 drafters alone).
    runs = [("two", 2, 2), ("one", 1, 2), ("three", 3, None)]
    got, resumes = [], []
    for name, drafters, budget in runs:
        config = write_config("elastic", **sections, pipeline=layout(drafters),
                              run={"max_steps_per_run": budget})
        events = finish(start_run(config))
        got += trained_batches(events)
        resumes += [e["step"] for e in events if e["event"] == "resume"]
        if name == "three":
            target = next(e for e in events if e["event"] == "start" and e.get("worker") == "target0")
            assert target["first_batch"] == 6 and target["batches"] == 6
            assert [e["step"] for e in events if e["event"] == "step"] == [5, 6]
            assert any("trains what its 2.0 epochs have left, to step 6" in e.get("message", "")
                       for e in events if e["event"] == "warning")
    assert resumes == [2, 4]
    assert Counter(got) == Counter(expected), got

    # The same data position at the end as the uninterrupted run: 48 examples taken, 12 batches.
    out = tmp_path / "elastic"
    single_state = load_checkpoint(latest_checkpoint(tmp_path / "single"))[1]["data"]
    _, state, meta = load_checkpoint(latest_checkpoint(out))
    assert state["data"] == single_state == {"epoch": 1, "cursor": 24, "num_examples": ROWS, "batches": 12}
    assert meta["data_position"] == state["data"] and meta["step"] == 6
