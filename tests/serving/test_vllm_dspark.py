"""vLLM's own DSpark code reads a DSpark export (`make serve-check`): its loader, heads and drafting loop.

vLLM does not serve DSpark on CPU (its DSpark speculator is the Triton model runner's), so
`benchmarks/vllm_dspark_driver.py` drives its parts directly in the serve venv (docs/SERVING.md): the config
from the export as `method: "dspark"`, `load_dspark_model` (the speculator's loader: `Qwen3DSparkForCausalLM`
and its `load_weights`), the corrected logits and confidences, and `DSparkSpeculator._sample_sequential`
over our backbone's outputs at every verify step of our decoding of the held-out prompts. A drafter trained
briefly on the tiny demo assets: vLLM loads every exported weight and nothing else, and drafts what we draft.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.serve import DSPARK_DRIVER, serve_venv_problem, train_tiny_drafter, vllm_generate
from dflash_ops.core.config import load_config
from dflash_ops.data.target import load_target
from dflash_ops.serve.dspark_decode import dspark_proposer
from dflash_ops.serve.evaluate import AcceptanceStats, end_of_text_id, eval_prompts, speculative_decode
from dflash_ops.serve.export import export_checkpoint
from dflash_ops.training.checkpoint import find_checkpoint, load_drafter

pytestmark = pytest.mark.serve
DSPARK = {"kind": "dspark", "markov_rank": 16, "confidence_head": True}
LOSS = {"kind": "mix", "weights": {"ce": 0.1, "tvd": 0.9, "bce": 1.0}}  # Model-Optimizer's defaults


def vllm_dspark(workdir, export, target_dir, inputs: dict, name: str) -> tuple[dict, dict]:
    config = json.loads((export / "config.json").read_text())
    save_file({key: value.contiguous() for key, value in inputs.items()}, workdir / f"{name}.in.safetensors")
    request = {"target": str(target_dir), "drafter": str(export), "dtype": "float32", "max_model_len": 512,
               "num_speculative_tokens": config["block_size"],  # a DSpark block drafts b tokens
               "inputs": str(workdir / f"{name}.in.safetensors"),
               "result_tensors": str(workdir / f"{name}.out.safetensors")}
    result = vllm_generate(request, workdir, name, driver=DSPARK_DRIVER)
    return result, load_file(result["tensors"])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    problem = serve_venv_problem()
    if problem:
        pytest.skip(problem)
    workdir = tmp_path_factory.mktemp("dspark")
    config_path, run = train_tiny_drafter(workdir, steps=200, model=DSPARK, loss=LOSS,
                                          data={"eval_path": None})
    cfg = load_config(config_path)
    export = export_checkpoint(find_checkpoint(run), workdir / "export", "float32")
    target = load_target(cfg.model.target_path)
    drafter, layer_ids = load_drafter(find_checkpoint(run), target)
    b = drafter.cfg.block_size
    # Our decoding of the held-out prompts; at each verify step the anchor, our backbone's block outputs
    # (the drafter's forward, hooked) and our drafts.
    steps: list[dict] = []
    hidden: list[torch.Tensor] = []
    hook = drafter.register_forward_hook(lambda module, args, output: hidden.append(output.detach().clone()))
    ours = dspark_proposer(drafter)

    def propose(sequence, context):
        drafts = ours(sequence, context)
        steps.append({"anchor": sequence[-1], "drafts": drafts})
        return drafts

    stats = AcceptanceStats("ours", b + 1)
    prompts = eval_prompts(Path(cfg.data.path).with_name("eval.jsonl"), cfg.data.max_length, 4)
    for prompt in prompts:
        speculative_decode(target, propose, prompt, layer_ids, b + 1, 24, end_of_text_id(target), stats)
    hook.remove()
    assert len(hidden) == len(steps) > 0
    generator = torch.Generator().manual_seed(0)
    probe_hidden = torch.randn(12, drafter.cfg.hidden_size, generator=generator)
    probe_prev = torch.randint(drafter.cfg.vocab_size, (12,), generator=generator)
    inputs = {"head_hidden": torch.cat(hidden), "anchors": torch.tensor([s["anchor"] for s in steps]),
              "probe_hidden": probe_hidden, "probe_prev": probe_prev}
    result, tensors = vllm_dspark(workdir, export, cfg.model.target_path, inputs, "dspark")
    return {"drafter": drafter, "steps": steps, "hidden": hidden, "inputs": inputs, "result": result,
            "tensors": tensors, "stats": stats, "export": export, "workdir": workdir,
            "target_dir": cfg.model.target_path}


def test_vllms_dspark_loader_loads_every_exported_weight_and_nothing_else(served):
    result = served["result"]
    assert result["method"] == "dspark" and result["class"] == "Qwen3DSparkForCausalLM"
    assert result["confidence_head"] is True
    # Everything but the unused placeholder vLLM declares (`mask_embedding`, dropped by its mapper) is
    # loaded from the export or is the target's own embedding and lm_head.
    assert result["not_loaded"] == ["model.mask_embedding"]
    assert result["shared_with_target"] == ["lm_head.weight", "model.embed_tokens.weight"]
    assert {"model.markov_head.markov_w1.weight", "model.markov_head.markov_w2.weight",
            "model.confidence_head.proj.weight", "model.confidence_head.proj.bias"} <= set(result["loaded"])


def test_vllms_heads_give_our_corrected_logits_and_confidences(served):
    drafter, inputs, tensors = served["drafter"], served["inputs"], served["tensors"]
    with torch.no_grad():
        logits = drafter.corrected_logits(inputs["probe_hidden"], inputs["probe_prev"])
        confidence = drafter.confidence(inputs["probe_hidden"], inputs["probe_prev"])
    torch.testing.assert_close(tensors["probe_logits"], logits.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tensors["probe_confidence"], confidence.float(), rtol=1e-5, atol=1e-6)
    assert logits.abs().max() > 0 and (logits.argmax(-1) == tensors["probe_logits"].argmax(-1)).all()


def test_vllms_drafting_loop_drafts_what_we_draft_at_every_verify_step(served):
    steps, tensors, drafter = served["steps"], served["tensors"], served["drafter"]
    b = drafter.cfg.block_size
    assert tensors["draft_tokens"].shape == (len(steps), b)
    for i, step in enumerate(steps):
        assert tensors["draft_tokens"][i].tolist() == step["drafts"], f"verify step {i}"
    # Its confidences are the head's at each drafted position, the Markov predecessor the token before it.
    prev = torch.tensor([[s["anchor"], *s["drafts"][:-1]] for s in steps])
    with torch.no_grad():
        ours = drafter.confidence(torch.cat(served["hidden"]), prev.reshape(-1)).reshape(len(steps), b)
    torch.testing.assert_close(tensors["draft_confidence"], ours.float(), rtol=1e-5, atol=1e-6)
    # A drafter whose drafts the target keeps, so that equal drafts are more than equal noise.
    assert served["stats"].as_dict()["tau"] > 1.3


def test_a_weight_vllm_has_no_parameter_for_fails_its_load_and_a_missing_one_is_reported(served):
    workdir, export = served["workdir"], served["export"]
    weights = load_file(export / "model.safetensors")
    inputs = served["inputs"]
    small = {"probe_hidden": inputs["probe_hidden"][:2], "probe_prev": inputs["probe_prev"][:2],
             "head_hidden": served["hidden"][0], "anchors": inputs["anchors"][:1]}
    renamed = workdir / "renamed"
    renamed.mkdir()
    (renamed / "config.json").write_text((export / "config.json").read_text())
    save_file({("markov_head.w1" if k == "markov_head.markov_w1.weight" else k): v
               for k, v in weights.items()}, renamed / "model.safetensors")
    with pytest.raises(RuntimeError, match="markov_head.w1"):
        vllm_dspark(workdir, renamed, served["target_dir"], small, "renamed")
    missing = workdir / "missing"
    missing.mkdir()
    (missing / "config.json").write_text((export / "config.json").read_text())
    save_file({k: v for k, v in weights.items() if k != "confidence_head.proj.bias"},
              missing / "model.safetensors")
    result, _ = vllm_dspark(workdir, missing, served["target_dir"], small, "missing")
    assert result["not_loaded"] == ["model.confidence_head.proj.bias", "model.mask_embedding"]
