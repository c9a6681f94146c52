"""`python -m dflash_ops.evaluate` on a DSpark drafter (`model.kind: dspark`): from a run's output directory
and from its export it loads the same drafter (the Markov and confidence heads included) and measures it as
vLLM's DSparkProposer drafts, b drafts a step, every row alike; a drafter of another kind than the config's
is refused."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_ops.core.config import ConfigError, config_from_dict
from dflash_ops.data.target import TargetHead, load_target
from dflash_ops.model.dspark import DSparkDrafter
from dflash_ops.run.main import run_single_process
from dflash_ops.serve.dspark_decode import dspark_proposer
from dflash_ops.serve.evaluate import evaluate
from dflash_ops.serve.evaluate import main as evaluate_main
from dflash_ops.serve.export import load_export
from dflash_ops.serve.export import main as export_main
from dflash_ops.training.checkpoint import latest_checkpoint, load_checkpoint, load_drafter
from dflash_ops.training.trainer import build_drafter, resolve_layer_ids


@pytest.fixture
def dspark_run(tiny_config, tmp_path, capsys):
    """Factory: `dspark_run(steps, confidence)` -> (config, run dir, its float32 export)."""

    def make(steps: int, confidence: bool = True):
        weights = {"ce": 0.1, "tvd": 0.9, **({"bce": 1.0} if confidence else {})}
        raw = tiny_config(tmp_path / "run", model={"kind": "dspark", "markov_rank": 8,
                                                   "confidence_head": confidence},
                          loss={"kind": "mix", "weights": weights},
                          optim={"total_steps": steps, "lr": 1e-2}, run={"save_every": steps})
        assert run_single_process(config_from_dict(raw)) == 0
        out = tmp_path / "export"
        args = ["--checkpoint", str(tmp_path / "run"), "--out", str(out), "--dtype", "float32"]
        assert export_main(args) == 0
        capsys.readouterr()
        return config_from_dict(raw), tmp_path / "run", out

    return make


def test_a_dspark_run_and_its_export_give_the_same_figures(dspark_run, tiny_eval_dataset, capsys):
    cfg, run, export = dspark_run(40)
    b = cfg.model.block_size
    common = ["--data", str(tiny_eval_dataset), "--num-prompts", "4", "--max-new-tokens", "24"]
    results = {}
    for name, source in {"checkpoint": run, "export": export}.items():
        config = latest_checkpoint(run) / "config.yaml"
        args = ["--config", str(config), "--checkpoint", str(source), "--json", *common]
        assert evaluate_main(args) == 0, capsys.readouterr().err
        results[name] = json.loads(capsys.readouterr().out)
    for result in results.values():
        assert result["drafter_kind"] == "dspark" and result["drafts_per_step"] == b
        # Every row drafts b a step (a DFlash proposer's b - 1 would be refused by the verify loop).
        assert [row["name"] for row in result["rows"]] == ["trained drafter", "untrained drafter",
                                                           "prompt lookup", "target as drafter"]
        assert all(len(row["acceptance_by_position"]) == b for row in result["rows"])
        assert result["rows"][3]["acceptance_by_position"][0] == 1.0  # the target's drafts: all accepted
    assert results["checkpoint"]["rows"] == results["export"]["rows"]
    assert sum(results["checkpoint"]["rows"][0]["accepted_by_position"]) > 0  # not two empty rows
    assert evaluate_main(["--checkpoint", str(run), *common]) == 0  # the table says what it measured
    assert f"acceptance by draft position 1..{b} (dspark drafter: {b} a step)" in capsys.readouterr().out


@pytest.mark.parametrize("confidence", [True, False], ids=["confidence", "markov-only"])
def test_load_drafter_and_load_export_give_the_trained_dsparks_logits(dspark_run, tiny_target, confidence):
    cfg, run, export = dspark_run(3, confidence)
    target = load_target(tiny_target)
    trained = build_drafter(cfg, TargetHead.of(target))
    trained.load_trainable_state_dict(load_checkpoint(latest_checkpoint(run))[0])
    assert trained.markov_head.markov_w2.weight.abs().sum() > 0  # trained away from its zero start
    torch.manual_seed(2)
    hidden, prev = torch.randn(9, trained.cfg.hidden_size), torch.randint(128, (9,))
    context, sequence = torch.randn(7, trained.cfg.num_target_features * trained.cfg.hidden_size), [5] * 8
    for loaded, layer_ids in (load_drafter(latest_checkpoint(run), target), load_export(export, target)):
        assert isinstance(loaded, DSparkDrafter)
        assert layer_ids == resolve_layer_ids(cfg, target.config.num_hidden_layers)
        assert (loaded.confidence_head is not None) is confidence
        with torch.no_grad():
            torch.testing.assert_close(loaded.corrected_logits(hidden, prev),
                                       trained.corrected_logits(hidden, prev), rtol=0, atol=0)
            if confidence:
                torch.testing.assert_close(loaded.confidence(hidden, prev), trained.confidence(hidden, prev),
                                           rtol=0, atol=0)
        assert dspark_proposer(loaded)(sequence, context) == dspark_proposer(trained)(sequence, context)


def test_a_drafter_of_another_kind_than_the_config_is_refused(dspark_run, tiny_config, tmp_path,
                                                             tiny_eval_dataset):
    _, run, export = dspark_run(3)
    dflash = config_from_dict(tiny_config(tmp_path / "other"))
    for source in (run, export):
        with pytest.raises(ConfigError, match="is a dspark drafter, the config's model.kind is dflash"):
            evaluate(dflash, source, tiny_eval_dataset, 8)
