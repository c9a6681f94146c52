"""A DSpark drafter's export, checked against vLLM's Qwen3 DSpark loader in `make test`: its
`Qwen3DSparkForCausalLM.load_weights` name mapping and `Qwen3DSparkModel`'s parameters are replayed from its
source (vllm-project/vllm vllm/model_executor/models/qwen3_dspark.py at
0302ff40439493d0db2e3bbfd509211703375d08,
dflash_ops.serve.export_dspark): nothing missing, nothing unexpected, every shape vLLM's; the corrected logits
its Markov head computes from the exported weights equal the trained drafter's. vLLM's own code (its loader,
heads and drafting loop) runs on the export in `make serve-check` (tests/serving/test_vllm_dspark.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_ops.core.config import config_from_dict
from dflash_ops.data.target import TargetHead, load_target
from dflash_ops.run.main import run_single_process
from dflash_ops.serve.export import main as export_main
from dflash_ops.serve.export import weight_name_problem
from dflash_ops.serve.export_dspark import (
    markov_logits,
    vllm_expected_shapes,
    vllm_loaded_names,
)
from dflash_ops.training.checkpoint import latest_checkpoint, load_checkpoint
from dflash_ops.training.trainer import build_drafter


@pytest.fixture(params=[True, False], ids=["confidence", "markov-only"])
def exported(tiny_config, tiny_target, tmp_path, capsys, request):
    confidence = request.param
    weights = {"ce": 0.1, "tvd": 0.9, **({"bce": 1.0} if confidence else {})}
    model = {"kind": "dspark", "markov_rank": 8, "confidence_head": confidence}
    raw = tiny_config(tmp_path / "run", model=model, loss={"kind": "mix", "weights": weights},
                      optim={"total_steps": 3})
    assert run_single_process(config_from_dict(raw)) == 0
    out = tmp_path / "export"
    assert export_main(["--checkpoint", str(tmp_path / "run"), "--out", str(out), "--dtype", "float32"]) == 0
    capsys.readouterr()
    return config_from_dict(raw), latest_checkpoint(tmp_path / "run"), out, request.param


def test_the_config_carries_the_keys_vllms_dspark_reads(exported):
    cfg, _, out, confidence = exported
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert "auto_map" not in config  # the shipped modeling file is DFlash's
    assert config["markov_rank"] == 8 and config["markov_head_type"] == "vanilla"
    assert config["enable_confidence_head"] is confidence
    assert config["confidence_head_with_markov"] is confidence
    assert config["draft_vocab_size"] == config["vocab_size"] == 128
    assert config["sample_from_anchor"] is True  # the block's first position predicts (as trained)
    assert config["dflash_config"]["mask_token_id"] == config["mask_token_id"]
    assert config["dflash_config"]["target_layer_ids"] == config["target_layer_ids"]


def test_vllms_loader_gets_every_weight_and_nothing_else(exported):
    _, _, out, confidence = exported
    config = json.loads((out / "config.json").read_text())
    weights = load_file(out / "model.safetensors")
    loaded = vllm_loaded_names(config, weights)
    backbone = {name: tuple(t.shape) for name, t in weights.items() if not name.startswith(("markov_head.",
                                                                                           "confidence_head."))}
    expected = vllm_expected_shapes(config, backbone)
    assert loaded == set(expected)
    assert {"model.markov_head.markov_w1.weight", "model.markov_head.markov_w2.weight"} <= loaded
    assert ("model.confidence_head.proj.weight" in loaded) is confidence
    for name, tensor in weights.items():
        assert tuple(tensor.shape) == tuple(expected["model." + name])
    assert weight_name_problem(config, weights) is None


def test_a_misnamed_or_misshaped_head_is_refused(exported):
    _, _, out, _ = exported
    config = json.loads((out / "config.json").read_text())
    weights = load_file(out / "model.safetensors")
    renamed = dict(weights)
    renamed["markov.w1"] = renamed.pop("markov_head.markov_w1.weight")
    problem = weight_name_problem(config, renamed)
    assert "missing model.markov_head.markov_w1.weight" in problem and "markov.w1" in problem
    transposed = dict(weights)
    transposed["markov_head.markov_w2.weight"] = weights["markov_head.markov_w2.weight"].T.contiguous()
    assert "of another shape: markov_head.markov_w2.weight" in weight_name_problem(config, transposed)


def test_vllms_markov_logits_from_the_export_equal_the_trained_drafters(exported, tiny_target):
    cfg, checkpoint, out, confidence = exported
    state, _, _ = load_checkpoint(checkpoint)
    drafter = build_drafter(cfg, TargetHead.of(load_target(tiny_target)))
    drafter.load_trainable_state_dict(state)
    weights = load_file(out / "model.safetensors")
    torch.manual_seed(2)
    hidden = torch.randn(9, drafter.cfg.hidden_size)
    prev = torch.randint(128, (9,))
    with torch.no_grad():
        ours = drafter.corrected_logits(hidden, prev)
        theirs = markov_logits(drafter.logits(hidden), prev, weights["markov_head.markov_w1.weight"],
                               weights["markov_head.markov_w2.weight"])
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
        if confidence:  # vLLM's DSparkConfidenceHead: proj(cat[hidden, w1[prev]].float()), sigmoid
            x = torch.cat([hidden, weights["markov_head.markov_w1.weight"][prev]], -1).float()
            vllm = torch.sigmoid(x @ weights["confidence_head.proj.weight"].T
                                 + weights["confidence_head.proj.bias"])[:, 0]
            torch.testing.assert_close(drafter.confidence(hidden, prev), vllm)
