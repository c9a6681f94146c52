"""The pipeline measures its ranks' waits and advises its split (dflash_ops.run.balance): a CPU pipeline made
slow on one side, by its shapes alone, is found bound by that side, with the split that moves a worker
to it; the validation predicts the split from the shapes, and the recipe's split is the one it advises."""

from __future__ import annotations

import json

import pytest

from dflash_ops.config import main as config_main
from dflash_ops.core.config import load_config
from dflash_ops.run.balance import Advice, MeasuredWaits, best_split, predicted_advice, predicted_costs
from dflash_ops.training.memory_fit import TargetShape
from tests.dflash.conftest import make_tiny_target

QWEN3_8B = TargetShape(num_layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128,
                       vocab=151936, tied=False)


def test_the_recipe_costs_what_the_shapes_say_and_its_split_is_the_balanced_one():
    cfg = load_config("configs/qwen3-8b.yaml", check_target=False)
    target, drafter = predicted_costs(cfg, QWEN3_8B)
    # 34 target layers over 3,072 tokens; 5 drafter layers over 8,192 queries, and the head over 7,680 rows.
    assert round(target / 1e12) == 43 and round(drafter / 1e12) == 72
    assert best_split(8, target, drafter) == (3, 5)
    advice = predicted_advice(cfg, QWEN3_8B)
    assert (advice.targets, advice.drafters, advice.best) == (3, 5, (3, 5))
    seeds = Advice(5, 3, target, drafter)  # the seeds' 5:3: the targets wait, 3:5 trains 1.67x as fast
    assert seeds.best == (3, 5) and seeds.gain == pytest.approx(1.67, abs=0.01)
    assert seeds.waits()[0] == pytest.approx(0.64, abs=0.01) and seeds.waits()[1] == 0


def test_validate_prints_the_predicted_split(write_config, capsys):
    config = write_config("split", pipeline={"target_workers": 2, "drafter_workers": 1})
    assert config_main(["validate", str(config)]) == 0
    out = capsys.readouterr().out
    assert "split (predicted from the shapes): targets wait" in out
    assert config_main(["validate", str(config), "--json"]) == 0
    split = json.loads(capsys.readouterr().out)["split"]
    assert split["split"] == [2, 1] and split["best_split"] in ([1, 2], [2, 1])


def test_the_measured_advice_sums_the_run_and_leaves_out_the_first_interval():
    waits = MeasuredWaits(targets=1, drafters=2)
    first = {"event": "step", "interval_steps": 1, "first_step_seconds": 9.0, "busy_s": 9.0,
             "wait_fraction": 0}
    waits.follow(first)  # compilation: not a drafter's cost
    waits.follow({"event": "waits", "worker": "target0", "batches": 4, "compute_s": 2.0, "wall_s": 2.0})
    assert waits.advice() is None  # no drafter interval yet
    for busy in (0.1, 0.1, 0.1):
        waits.follow({"event": "step", "interval_steps": 1, "busy_s": busy, "wait_fraction": 0.8})
    fields = waits.advice()
    assert (fields["bound"], fields["best_split"]) == ("target-bound", [2, 1])
    # One slow interval (a drafter's collective on a busy machine) moves the sums, not the advice.
    waits.follow({"event": "step", "interval_steps": 1, "busy_s": 0.5, "wait_fraction": 0.0})
    fields = waits.advice()
    assert (fields["bound"], fields["best_split"]) == ("target-bound", [2, 1])
    # Waited 0.4 s in each of three intervals, busy 0.8 s in all.
    assert fields["drafter_wait"] == pytest.approx(1.2 / (1.2 + 0.8), abs=1e-3)
    assert fields["target_wait"] == 0 and "0.2 s" in fields["advice"]  # 2.0 s over 4 batches, 0.8 s over 4


@pytest.mark.slow
@pytest.mark.parametrize("slow_side", ["drafter", "target"])
def test_an_unbalanced_pipeline_says_which_side_binds_and_the_split_to_use(write_config, start_run, demo_dir,
                                                                          tmp_path, slow_side):
    if slow_side == "drafter":  # a cheap target; a drafter of 4 layers over 64 anchors of 8 a row
        sections = {"model": {"num_draft_layers": 4}, "data": {"max_anchors": 56},
                    "pipeline": {"target_workers": 2, "drafter_workers": 1}}
        expected = ("drafter-bound", [1, 2])
    else:  # a 20-layer target 4x wider than the demo's; a drafter of 1 layer over 2 anchors a row. Quiet,
        # a batch costs the target ~3x the drafter's step; on a busy machine the drafters' collectives
        # slow them most (at 12 layers they came within 6 % of the target under a loaded test run).
        target = make_tiny_target(tmp_path / "wide-target", vocab_size=384, hidden_size=256,
                                  intermediate_size=1024, num_hidden_layers=20, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
        sections = {"model": {"target_path": str(target), "target_layer_ids": [18]},
                    "data": {"max_anchors": 2},
                    "pipeline": {"target_workers": 1, "drafter_workers": 2}}
        expected = ("target-bound", [2, 1])
    sections["pipeline"].update(threads_per_worker=1, queue_depth=2)
    sections["data"]["eval_path"] = None
    config = write_config(f"slow-{slow_side}", optim={"total_steps": 16}, **sections)
    run = start_run(config)
    assert run.wait(timeout=300) == 0, run.log_path.read_text()[-3000:]
    lines = [e for e in run.events() if e["event"] == "balance"]
    assert lines, run.log_path.read_text()[-3000:]
    last = run.status()["balance"]
    assert (last["bound"], last["best_split"]) == expected, lines[-3:]
    print(last["advice"])
    assert last["advice"] == lines[-1]["advice"] and last["gain"] > 1
    waits = [e for e in run.events() if e["event"] == "waits"]
    assert waits and all(e["worker"].startswith("target") and e["compute_s"] > 0 for e in waits)
