"""`model.kind: dspark` in the trainer: a run trains the backbone and both heads with Model-Optimizer's mix
and resumes; the config refuses bce without the confidence head."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_ops.core.config import ConfigError, config_from_dict
from dflash_ops.run.main import run_single_process
from dflash_ops.training.checkpoint import latest_checkpoint, load_checkpoint

DSPARK = {"kind": "dspark", "markov_rank": 8, "confidence_head": True}
MIX = {"kind": "mix", "weights": {"ce": 0.1, "tvd": 0.9, "bce": 1.0}}


def _losses(out: str) -> list[float]:
    return [r["loss"] for r in map(json.loads, (line for line in out.splitlines() if line.startswith("{")))
            if r.get("event") == "step"]


def test_a_dspark_run_trains_its_heads_and_the_loss_goes_down(tiny_config, tmp_path, capsys):
    raw = tiny_config(tmp_path / "run", model=DSPARK, loss=MIX, optim={"total_steps": 12},
                      run={"save_every": 12})
    assert run_single_process(config_from_dict(raw)) == 0
    losses = _losses(capsys.readouterr().out)
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    state, _, meta = load_checkpoint(latest_checkpoint(tmp_path / "run"))
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias"} <= set(state)
    assert state["markov_head.markov_w2.weight"].abs().sum() > 0, "the Markov head trained from zero"
    assert state["confidence_head.proj.weight"].dtype == torch.float32


def test_a_dspark_run_resumes_to_the_uninterrupted_losses(tiny_config, tmp_path, capsys):
    raw = tiny_config(tmp_path / "whole", model=DSPARK, loss=MIX, optim={"total_steps": 6},
                      run={"save_every": 3})
    assert run_single_process(config_from_dict(raw)) == 0
    whole = _losses(capsys.readouterr().out)
    raw = tiny_config(tmp_path / "split", model=DSPARK, loss=MIX, optim={"total_steps": 6},
                      run={"save_every": 3, "max_steps_per_run": 3})
    assert run_single_process(config_from_dict(raw)) == 0
    assert run_single_process(config_from_dict(raw)) == 0
    assert _losses(capsys.readouterr().out) == pytest.approx(whole, rel=1e-6)


def test_a_resume_under_another_kind_or_head_is_refused(tiny_config, tmp_path, capsys):
    import yaml

    from dflash_ops.run.main import main as train_main

    run = {"save_every": 2, "max_steps_per_run": 2}
    assert run_single_process(config_from_dict(tiny_config(tmp_path / "run", optim={"total_steps": 4},
                                                           run=run))) == 0
    for model, loss, key in [(DSPARK, MIX, "model.kind"),
                             ({**DSPARK, "confidence_head": False}, {"kind": "ce"}, "model.kind")]:
        path = tmp_path / "changed.yaml"
        path.write_text(yaml.safe_dump(tiny_config(tmp_path / "run", model=model, loss=loss,
                                                   optim={"total_steps": 4}, run=run)))
        capsys.readouterr()
        assert train_main(["--config", str(path)]) == 2
        assert key in capsys.readouterr().err


def test_bce_needs_the_dspark_confidence_head(tiny_config, tmp_path):
    for model in ({}, {"kind": "dspark"}):
        with pytest.raises(ConfigError) as err:
            config_from_dict(tiny_config(tmp_path, model=model, loss=MIX))
        assert err.value.key == "loss.weights"
    with pytest.raises(ConfigError) as err:
        config_from_dict(tiny_config(tmp_path, model={"kind": "medusa"}))
    assert err.value.key == "model.kind"
    with pytest.raises(ConfigError) as err:  # an untrained confidence head
        config_from_dict(tiny_config(tmp_path, model=DSPARK, loss={"kind": "mix", "weights": {"ce": 1.0}}))
    assert err.value.key == "model.confidence_head"


def test_a_dspark_run_with_held_out_data_logs_its_held_out_tau(tiny_config, tiny_eval_dataset, tmp_path,
                                                                capsys):
    """data.eval_path in a DSpark run: the held-out figures are the DSpark drafter's (b drafts a step, tau
    up to b + 1; tests/dflash/training/test_heldout_dspark.py checks them against dflash_ops.evaluate), in
    the log and metrics.jsonl, and run.keep_best keeps the best of them."""
    from dflash_ops.training.plots import read_metrics

    raw = tiny_config(tmp_path / "run", model=DSPARK, loss=MIX, optim={"total_steps": 4},
                      data={"eval_path": str(tiny_eval_dataset)},
                      run={"save_every": 2, "eval_every": 2, "keep_best": True})
    assert run_single_process(config_from_dict(raw)) == 0
    b = raw["model"]["block_size"]
    records = [r for r in map(json.loads, (line for line in capsys.readouterr().out.splitlines()
                                           if line.startswith("{"))) if r.get("event") == "heldout"]
    assert [r["step"] for r in records] == [2, 4]
    for record in records:
        assert 1.0 <= record["heldout_tau"] <= b + 1 and record["heldout_loss"] > 0
        assert len(record["heldout_acceptance_by_position"]) == b  # position 0's draft counted too
    assert sorted(read_metrics(tmp_path / "run")["heldout"]) == [2, 4]


def test_the_dspark_recipe_validates_at_qwen3_8b_and_its_split_advice_counts_the_heads(tmp_path):
    """configs/qwen3-8b-dspark.yaml: Model-Optimizer's DSpark recipe on the DFlash recipe's container;
    validate fits it on 80 GB GPUs, and the split advice's costs count the last target layers it runs (36 of
    36, its last hidden state) and the drafter's extra head work."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from dflash_ops.core.config import load_config
    from dflash_ops.core.loss_section import extra_head_flops
    from dflash_ops.run.balance import drafter_flops, predicted_costs
    from dflash_ops.training.memory_fit import QWEN3_8B

    repo = Path(__file__).resolve().parents[3]
    target = tmp_path / "qwen3-8b"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False}))
    paths = {}
    for name in ("qwen3-8b", "qwen3-8b-dspark"):
        raw = yaml.safe_load((repo / "configs" / f"{name}.yaml").read_text())
        raw["model"]["target_path"] = str(target)
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(raw))
    cfg = load_config(paths["qwen3-8b-dspark"], check_target=False)
    assert (cfg.model.kind, cfg.model.markov_rank, cfg.model.confidence_head) == ("dspark", 256, True)
    assert cfg.loss.mix == {"ce": 0.1, "tvd": 0.9, "bce": 1.0} and cfg.data.max_anchors == 256
    assert (cfg.model.block_size, cfg.gamma, cfg.optim.schedule) == (16, 7.0, "linear")
    command = [sys.executable, "-m", "dflash_ops.config", "validate", str(paths["qwen3-8b-dspark"]),
               "--no-target-check", "--gpu-memory", "80GB"]
    done = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "memory fits" in done.stdout, done.stdout + done.stderr
    target_flops, drafter = predicted_costs(cfg, QWEN3_8B)
    dflash_target, _ = predicted_costs(load_config(paths["qwen3-8b"], check_target=False), QWEN3_8B)
    assert target_flops / dflash_target == pytest.approx(36 / 34)  # layers 0..35 instead of 0..33
    base = drafter_flops(QWEN3_8B, 3072, 256, 16, 5, 5)
    assert drafter == pytest.approx(base + extra_head_flops(cfg.loss.mix, 256, 256, 16, 4096, 151936))
    assert drafter / base > 1.1  # the target's logits, the Markov head and the checkpointed head's recompute


DFLASH_MIX = {"kind": "mix", "weights": {"ce": 0.1, "kl": 0.2, "tvd": 0.7}}


@pytest.mark.parametrize("sections", [{"loss": DFLASH_MIX}, {"model": DSPARK, "loss": MIX}],
                         ids=["dflash-mix", "dspark"])
def test_the_mix_and_dspark_steps_never_read_the_device_in_the_hot_path(monkeypatch, tiny_target, tiny_config,
                                                                        tmp_path, sections):
    """tests/dflash/training/test_host_syncs.py's count, for the losses against the target's distribution."""
    from dflash_ops.data.target import TargetHead, load_target, target_hidden_states
    from dflash_ops.training.trainer import DrafterTrainer, build_drafter
    from tests.dflash.training.test_host_syncs import HostReads

    model = {"num_draft_layers": 2, **sections.get("model", {})}
    cfg = config_from_dict(tiny_config(tmp_path, model=model, loss=sections["loss"]))
    target = load_target(tiny_target, "float32")
    torch.manual_seed(0)
    trainer = DrafterTrainer(build_drafter(cfg, TargetHead.of(target)), cfg)
    g = torch.Generator().manual_seed(0)

    def batch():
        input_ids = torch.randint(0, 100, (3, 20), generator=g)
        packed = target_hidden_states(target, input_ids, torch.ones_like(input_ids), [1, 3, 3])  # + the last
        tokens = packed.pack(input_ids)
        return packed.features, packed.cu_seqlens, packed.position_ids, tokens, torch.ones_like(tokens)

    trainer.train_step(*batch())
    reads, inputs = HostReads(monkeypatch), batch()
    reads.counting = True
    result = trainer.train_step(*inputs)
    reads.counting = False
    assert result.num_blocks > 0 and result.loss > 0
    assert reads.in_hot_path() == [] and reads.unlisted() == []
