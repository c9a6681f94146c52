"""An export reloads on the serving side: under the project's transformers and under 4.57.1 (what the
public DFlash code pins), `AutoModel.from_pretrained(dir, trust_remote_code=True)` builds the drafter
with no missing or unexpected weights, its RoPE frequencies are the target's (a base of 1e6, not
Qwen3Config's default 10000), its config keeps the layer types and sliding window, its block
logits are ours (with a sliding-window layer too), and the public code's `draft.spec_generate(...)`
gives the target's greedy output.

Each load runs `export_compat_check.py` in a fresh interpreter that does not see this package: the
export directory has to carry everything. The 4.57.1 interpreter is the venv of `make compat-venv`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_ops.core.config import config_from_dict
from dflash_ops.data.target import load_target
from dflash_ops.model.drafter import DFlashDrafter, DrafterConfig
from dflash_ops.model.loss import build_block_attention_mask
from dflash_ops.run.main import run_single_process
from dflash_ops.serve.export import load_export
from dflash_ops.serve.export import main as export_main
from dflash_ops.training.checkpoint import latest_checkpoint, load_drafter
from tests.dflash.conftest import _tiny_config_dict, make_tiny_target

REPO = Path(__file__).resolve().parents[3]
CHECK_SCRIPT = Path(__file__).with_name("export_compat_check.py")
COMPAT_VENV = REPO / ".cache" / "compat-venv"
ROPE_THETA = 1_000_000.0  # Qwen3's; transformers 4's Qwen3Config falls back to 10000 without it
DTYPES = ("float32", "bfloat16")


# The exports checked: (layer types, dtype). A sliding window (6) shorter than the block's context (11).
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}
CASES = [("full", "float32"), ("full", "bfloat16"), ("sliding", "float32")]


def build_exports(root: Path, target_dir: Path, tiny_dataset: Path, model: dict) -> dict:
    """A drafter trained briefly on the target at `target_dir` with the extra `model` keys,
    exported in both dtypes under `root`; the block inputs of one decoding step, and our logits."""
    raw = _tiny_config_dict(target_dir, tiny_dataset, root / "run",
                            model={"num_draft_layers": 2, "block_size": 4, **model}, optim={"total_steps": 3})
    assert run_single_process(config_from_dict(raw)) == 0
    for dtype in DTYPES:
        assert export_main(["--checkpoint", str(root / "run"), "--out", str(root / dtype),
                            "--dtype", dtype]) == 0
    target = load_target(target_dir)
    assert float(target.model.rotary_emb.inv_freq[1]) == pytest.approx(ROPE_THETA ** (-2 / 8))  # head_dim 8
    trained, _ = load_drafter(latest_checkpoint(root / "run"), target)
    cfg = trained.cfg
    n = 11
    torch.manual_seed(1)
    context = torch.randn(n, cfg.num_target_features * cfg.hidden_size)
    block_ids = torch.full((cfg.block_size,), cfg.mask_token_id)
    block_ids[0] = 7
    positions = torch.arange(n + cfg.block_size)
    mask = build_block_attention_mask(torch.zeros(n, dtype=torch.long), positions[:n],
                                      torch.zeros(1, dtype=torch.long), torch.tensor([n]), cfg.block_size)
    inputs = {"target_hidden": context[None], "position_ids": positions[None], "attention_mask": mask,
              "noise_embedding": target.get_input_embeddings()(block_ids)[None],
              "lm_head": target.get_output_embeddings().weight}
    # A stop token that the target's greedy continuation of the prompt reaches after a few tokens.
    prompt = torch.tensor([3, 17, 29, 41, 5, 66])
    with torch.no_grad():
        greedy = target.generate(input_ids=prompt[None], attention_mask=torch.ones_like(prompt)[None],
                                 do_sample=False, max_new_tokens=24)[0, len(prompt):]
    stop_at = next(i for i in range(8, len(greedy)) if greedy[i] not in greedy[:i])
    inputs.update(prompt=prompt, stop_token_id=greedy[stop_at])
    save_file({k: v.detach().contiguous() for k, v in inputs.items()}, str(root / "inputs.safetensors"))

    def logits(drafter):
        with torch.no_grad():
            return drafter.logits(drafter(context, positions[:n], block_ids, positions[n:], mask))

    ours = {dtype: logits(load_export(root / dtype, target)[0]) for dtype in DTYPES}
    if cfg.sliding_window is not None:  # the window changes these logits: the check sees it applied
        full = DrafterConfig(**{**cfg.__dict__, "layer_types": None, "sliding_window": None})
        unwindowed = DFlashDrafter(full, trained.embed_tokens, trained.lm_head)
        unwindowed.load_trainable_state_dict(trained.trainable_state_dict())
        assert not torch.allclose(logits(unwindowed), logits(trained))
    return {"root": root, "target_dir": target_dir, "target": target, "ours": ours,
            "checkpoint": logits(trained), "greedy": torch.cat([prompt, greedy[:stop_at + 1]]),
            "layer_types": {"layer_types": cfg.layer_types, "sliding_window": cfg.sliding_window}}


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_dataset):
    """Per layer types ("full", "sliding"): `build_exports` for a tiny target with RoPE base 1e6."""
    root = tmp_path_factory.mktemp("compat")
    target_dir = make_tiny_target(root / "target",
                                  rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA})
    # Qwen3's own config.json has the top-level form too, so transformers 4 loads the target right.
    target_config = json.loads((target_dir / "config.json").read_text())
    (target_dir / "config.json").write_text(json.dumps({**target_config, "rope_theta": ROPE_THETA}))
    return {name: build_exports(root / name, target_dir, tiny_dataset, model)
            for name, model in (("full", {}), ("sliding", SLIDING))}


def check_export(python: Path | str, exports: dict, dtype: str, tmp_path: Path) -> dict:
    """Run the check script under `python` on the `dtype` export of `exports` (one of the fixture's);
    assert what every reader must get."""
    export_dir, modules = exports["root"] / dtype, tmp_path / "modules"
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "HF_HOME")}
    # Remote code is copied into HF_MODULES_CACHE: a private one, so no test shares or leaves one.
    env.update(HF_MODULES_CACHE=str(modules), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    run = subprocess.run([str(python), str(CHECK_SCRIPT), str(export_dir), str(exports["target_dir"]),
                          str(exports["root"] / "inputs.safetensors"), str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    tensors = load_file(str(tmp_path / "result.safetensors"))

    assert result["class"] == "DFlashDraftModel"
    assert (result["missing_keys"], result["unexpected_keys"], result["mismatched_keys"]) == ([], [], [])
    assert result["parameters"] == sorted(load_file(str(export_dir / "model.safetensors")))
    target_inv_freq = exports["target"].model.rotary_emb.inv_freq
    assert torch.equal(tensors["public_inv_freq"], target_inv_freq)
    assert torch.equal(tensors["model_inv_freq"], target_inv_freq)
    # Ours reloads the same export in fp32, as the check does: the same weights, the same layers.
    assert torch.equal(tensors["logits"], exports["ours"][dtype])
    # The public code's call: the target's greedy output, up to and including the stop token.
    assert torch.equal(tensors["greedy"], exports["greedy"])
    assert torch.equal(tensors["spec_generate"], exports["greedy"])
    if dtype == "bfloat16":
        torch.testing.assert_close(tensors["logits"], exports["checkpoint"], rtol=0, atol=2e-2)
    else:
        assert torch.equal(tensors["logits"], exports["checkpoint"])
    return result


@pytest.mark.parametrize(("layers", "dtype"), CASES)
def test_the_export_loads_with_automodel_under_the_projects_transformers(exports, layers, dtype, tmp_path):
    import transformers

    result = check_export(sys.executable, exports[layers], dtype, tmp_path)
    assert result["transformers"] == transformers.__version__
    assert result["layer_types"] == exports[layers]["layer_types"]


@pytest.mark.parametrize(("layers", "dtype"), CASES)
def test_the_export_loads_with_automodel_under_transformers_4_57_1(exports, layers, dtype, tmp_path):
    python = COMPAT_VENV / "bin" / "python"
    if not (COMPAT_VENV / ".complete").is_file():
        pytest.skip(f"no transformers 4.57.1 venv at {COMPAT_VENV}: build it with `make compat-venv`")
    result = check_export(python, exports[layers], dtype, tmp_path)
    assert result["transformers"] == "4.57.1"
    assert result["rope_theta"] == ROPE_THETA  # the attribute 4.x's Qwen3 code reads
    assert result["layer_types"] == exports[layers]["layer_types"]
