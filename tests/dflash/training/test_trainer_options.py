"""The trainer's options users of other trainers expect: gradient accumulation (optim.accumulate, the step
of the larger batch), the learning-rate schedule as a choice (optim.schedule), and a batch larger than the
data refused rather than filled with repeated rows, and run.keep_best sparing the best held-out checkpoint
from pruning."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from dflash_ops.core.config import ConfigError, config_from_dict, load_config
from dflash_ops.run.main import main as train_main
from dflash_ops.run.main import run_single_process
from dflash_ops.training.checkpoint import latest_checkpoint, load_checkpoint
from dflash_ops.training.trainer import lr_multiplier


def events(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def write(path: Path, raw: dict) -> str:
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def trained(tiny_config, out: Path, capsys, batch_size: int, accumulate: int):
    """Three steps of the tiny run at `batch_size` x `accumulate` (no clipping, no warmup): the weights,
    the data position and the step lines."""
    raw = tiny_config(out, data={"batch_size": batch_size},
                      optim={"total_steps": 3, "accumulate": accumulate, "max_grad_norm": 1.0e9,
                             "warmup_ratio": 0.0},
                      run={"save_every": 1000})
    capsys.readouterr()
    assert run_single_process(config_from_dict(raw)) == 0
    steps = [r for r in events(capsys.readouterr().out) if r["event"] == "step"]
    weights, state, _ = load_checkpoint(latest_checkpoint(out))
    return weights, state["data"], steps


def test_two_micro_batches_of_b_take_the_step_of_one_batch_of_2b(tiny_config, tmp_path, capsys):
    """The data order is the same permutation whatever the batch size, so two micro-batches of 2 are the
    rows of one batch of 4: after three optimizer steps the weights agree to float tolerance, the
    position in the data is the same, and each step line counts the same loss, tokens and rows."""
    big_weights, big_position, big_steps = trained(tiny_config, tmp_path / "big", capsys, 4, 1)
    acc_weights, acc_position, acc_steps = trained(tiny_config, tmp_path / "acc", capsys, 2, 2)
    one_weights, _, _ = trained(tiny_config, tmp_path / "one", capsys, 2, 1)
    position = ("epoch", "cursor")
    assert {k: acc_position[k] for k in position} == {k: big_position[k] for k in position} == \
        {"epoch": 0, "cursor": 12}
    assert len(acc_steps) == len(big_steps) == 3
    for got, want in zip(acc_steps, big_steps, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        assert got["lr"] == want["lr"]
        assert {k: got[k] for k in ("blocks",)} == {k: want[k] for k in ("blocks",)}
    assert set(acc_weights) == set(big_weights) and len(big_weights) > 4
    moved = 0
    for name, want in big_weights.items():
        torch.testing.assert_close(acc_weights[name], want, rtol=1e-4, atol=1e-5, msg=name)
        moved += not torch.allclose(one_weights[name], want, rtol=1e-4, atol=1e-5)
    assert moved  # a batch of 2 alone trains otherwise: the comparison can tell


def test_accumulate_counts_in_the_steps_of_epochs_and_is_checked(tiny_config, tmp_path):
    raw = tiny_config(tmp_path / "run", optim={"total_steps": None, "epochs": 1.5, "accumulate": 3})
    cfg = load_config(write(tmp_path / "c.yaml", raw))
    assert cfg.total_steps == math.ceil(48 / (4 * 3)) and cfg.step_plan["accumulate"] == 3
    with pytest.raises(ConfigError, match=r"optim.accumulate: must be >= 1"):
        config_from_dict(tiny_config(tmp_path / "run", optim={"accumulate": 0}))
    pipeline = {"device": "cpu", "target_workers": 1, "drafter_workers": 2}
    with pytest.raises(ConfigError, match=r"optim.accumulate: must be 1 in a pipeline"):
        config_from_dict(tiny_config(tmp_path / "run", optim={"accumulate": 2}, pipeline=pipeline))


def test_the_schedule_is_a_choice_with_warmup_and_cosine_stays_the_default():
    warmup, total = 4, 20
    cosine = [lr_multiplier(s, warmup, total) for s in range(total)]
    assert cosine == [lr_multiplier(s, warmup, total, "cosine") for s in range(total)]
    for schedule in ("cosine", "linear", "constant"):
        warming = [lr_multiplier(s, warmup, total, schedule) for s in range(warmup)]
        assert warming == pytest.approx([0.25, 0.5, 0.75, 1.0])
    linear = [lr_multiplier(s, warmup, total, "linear") for s in (4, 8, 12, 20)]
    assert linear == pytest.approx([1, 0.75, 0.5, 0])
    assert [lr_multiplier(s, warmup, total, "constant") for s in (4, 12, 19, 20)] == [1.0] * 4
    assert lr_multiplier(12, warmup, total) == pytest.approx(0.5)


@pytest.mark.parametrize("schedule", ["linear", "constant"])
def test_a_run_trains_by_the_configured_schedule(schedule, tiny_config, tmp_path, capsys):
    raw = tiny_config(tmp_path / "run", optim={"total_steps": 8, "warmup_ratio": 0.25, "schedule": schedule},
                      run={"save_every": 1000})
    capsys.readouterr()
    assert run_single_process(config_from_dict(raw)) == 0
    lrs = [r["lr"] for r in events(capsys.readouterr().out) if r["event"] == "step"]
    want = [3e-3 * lr_multiplier(s, 2, 8, schedule) for s in range(8)]
    assert lrs == pytest.approx(want, rel=1e-9)
    assert lrs[5] == pytest.approx(3e-3 if schedule == "constant" else 3e-3 * 3 / 6)  # halfway down


def test_an_unknown_schedule_is_refused(tiny_config, tmp_path):
    with pytest.raises(ConfigError, match=r"optim.schedule: must be one of cosine, linear, constant, got"):
        config_from_dict(tiny_config(tmp_path / "run", optim={"schedule": "wsd"}))


@pytest.mark.parametrize(("batch", "accumulate"), [(40, 1), (20, 2)])
def test_a_step_larger_than_the_data_is_refused_before_training(batch, accumulate, tiny_config, tmp_path,
                                                                  capsys):
    """32 rows: a step of 40 rows would hold rows twice; the run says so and exits 2, nothing trained."""
    out = tmp_path / "run"
    config = write(tmp_path / "c.yaml", tiny_config(out, data={"batch_size": batch},
                                                     optim={"accumulate": accumulate}))
    capsys.readouterr()
    assert train_main(["--config", config]) == 2
    _, err = capsys.readouterr()
    assert "data.batch_size: a step takes 40 rows" in err and "holds 32 training examples" in err
    assert latest_checkpoint(out) is None


def test_keep_best_spares_the_best_heldout_checkpoint_from_pruning(tmp_path):
    """Held-out tau peaks at step 2: with run.keep_checkpoints 1, steps 3-5 prune their predecessors but
    step 2's checkpoint stays, until a better tau (step 5's) takes its place; it is the one --best exports."""
    from dflash_ops.serve.export import best_step
    from dflash_ops.training.best_checkpoint import best_step_to_keep
    from dflash_ops.training.checkpoint import list_checkpoints, save_checkpoint, step_of

    taus = {1: 1.5, 2: 3.25, 3: 2.0, 4: 3.25 - 0.5, 5: 3.5}
    metrics = tmp_path / "metrics.jsonl"
    kept = []
    for step, tau in taus.items():
        with metrics.open("a") as f:
            f.write(json.dumps({"kind": "heldout", "step": step, "heldout_tau": tau}) + "\n")
        spare = best_step_to_keep(tmp_path, step, {})
        save_checkpoint(tmp_path, step, {"w": torch.zeros(1)}, {}, "", {}, keep=1, spare=spare)
        kept.append(sorted(step_of(p) for p in list_checkpoints(tmp_path)))
        if step == 4:
            assert best_step(tmp_path) == 2
    assert kept == [[1], [2], [2, 3], [2, 4], [5]]
    assert best_step(tmp_path) == 5


def test_a_run_with_keep_best_holds_the_best_and_the_latest(tiny_config, tiny_eval_dataset, tmp_path,
                                                            monkeypatch):
    """The tiny drafter's tau does not move in six steps: the held-out evaluation is scripted to peak at
    step 2, and the run ends with step 2's checkpoint beside its latest (run.keep_checkpoints 1)."""
    from dflash_ops.serve.export import best_step
    from dflash_ops.training.checkpoint import list_checkpoints, step_of
    from dflash_ops.training.heldout import HeldOutEvaluator

    scripted = iter([1.5, 3.25, 2.0, 2.75, 1.0, 1.25])

    class Figures:
        def __init__(self, tau):
            self.tau = tau

        def as_fields(self):
            return {"heldout_loss": 1.0, "heldout_tau": self.tau}

    monkeypatch.setattr(HeldOutEvaluator, "__call__", lambda self, drafter: Figures(next(scripted)))
    out = tmp_path / "run"
    raw = tiny_config(out, data={"eval_path": str(tiny_eval_dataset)}, optim={"total_steps": 6},
                      run={"save_every": 1, "eval_every": 1, "keep_checkpoints": 1, "keep_best": True})
    assert run_single_process(config_from_dict(raw)) == 0
    assert sorted(step_of(p) for p in list_checkpoints(out)) == [2, 6]
    assert best_step(out) == 2
    with pytest.raises(ConfigError, match="run.keep_best: keeps the checkpoint of the best held-out tau"):
        config_from_dict(tiny_config(out, run={"keep_best": True}))


def test_a_stop_between_micro_batches_gives_them_back_to_the_data_order():
    """A stop that comes after the first of two micro-batches takes no step: the data order goes back to
    where the step began, so that a resume trains that batch (the checkpoint records the position)."""
    from types import SimpleNamespace

    from dflash_ops.data.examples import BatchOrder
    from dflash_ops.training.drafter_run import DrafterRun

    order = BatchOrder(32, 2, seed=0)
    order.next_batch()
    before = order.state_dict()

    class Source:
        stop_reason = ""

        def __init__(self, batches: int):
            self.left = batches

        def next_batch(self, stop):
            if not self.left:
                self.stop_reason = "signal SIGTERM"
                return None
            self.left -= 1
            return {"indices": order.next_batch()}

    run = SimpleNamespace(cfg=SimpleNamespace(optim=SimpleNamespace(accumulate=2)), order=order)
    assert DrafterRun.micro_batches(run, Source(1), None) is None
    assert order.state_dict() == before
    fresh = BatchOrder(32, 2, seed=0)
    want = [fresh.next_batch() for _ in range(3)][1:]  # the batches after the first: none was skipped
    assert [b["indices"] for b in DrafterRun.micro_batches(run, Source(2), None)] == want
