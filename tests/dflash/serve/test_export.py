"""Export for serving: the directory reloads into the checkpoint's drafter bit for bit, and a
DFlashDraftModel-shaped stack built from transformers' own Qwen3 parts loads it strictly and gives
the same block logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import Qwen3Config
from transformers.masking_utils import sliding_window_causal_mask_function
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from dflash_ops.core.config import config_from_dict
from dflash_ops.data.target import load_target
from dflash_ops.model.loss import build_block_attention_mask
from dflash_ops.run.main import run_single_process
from dflash_ops.serve.export import load_export
from dflash_ops.serve.export import main as export_main
from dflash_ops.training.checkpoint import latest_checkpoint, load_drafter

REPO = Path(__file__).resolve().parents[3]


class ReferenceAttention(nn.Module):
    """DFlashDraftModel's attention: queries from the block, keys/values from [context; block]."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.head_dim, h = config.head_dim, config.hidden_size
        self.groups = config.num_attention_heads // config.num_key_value_heads
        self.q_proj = nn.Linear(h, config.num_attention_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, h, bias=config.attention_bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, block, context, cos, sin, mask):
        q_len, kv_len = block.shape[1], context.shape[1] + block.shape[1]
        q = self.q_norm(self.q_proj(block).view(1, q_len, -1, self.head_dim)).transpose(1, 2)
        k = torch.cat([self.k_proj(context), self.k_proj(block)], dim=1).view(1, kv_len, -1, self.head_dim)
        v = torch.cat([self.v_proj(context), self.v_proj(block)], dim=1).view(1, kv_len, -1, self.head_dim)
        k, v = self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
        k = k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)
        # None: not causal, the block sees itself and the context; else a sliding layer's window.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(1, q_len, -1))


class ReferenceLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = ReferenceAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, block, context, cos, sin, mask):
        block = block + self.self_attn(self.input_layernorm(block), context, cos, sin, mask)
        return block + self.mlp(self.post_attention_layernorm(block))


class ReferenceDrafter(nn.Module):
    """Module names and forward of DFlashDraftModel, from the exported config alone; a
    sliding_attention layer masks with transformers' own sliding window of `sliding_window`."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        n_features = len(config.dflash_config["target_layer_ids"])
        self.layers = nn.ModuleList(ReferenceLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(n_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.layer_types, self.window = config.layer_types, config.sliding_window

    def forward(self, target_hidden, noise_embedding, position_ids):
        context = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        positions = position_ids[0]
        queries = positions[-noise_embedding.shape[1]:]
        sliding = None if self.window is None else sliding_window_causal_mask_function(self.window)(
            0, 0, queries[:, None], positions[None, :])
        block = noise_embedding
        for layer, layer_type in zip(self.layers, self.layer_types, strict=True):
            block = layer(block, context, cos, sin, sliding if layer_type == "sliding_attention" else None)
        return self.norm(block)


# A window shorter than block_inputs' context (11 tokens), on the first of the two layers.
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}


@pytest.fixture
def exported(tiny_config, tiny_target, tmp_path, capsys, request):
    """A trained drafter's checkpoint, its float32 export and the target; `request.param`: more
    model keys (layer types)."""
    raw = tiny_config(tmp_path / "run", model={"num_draft_layers": 2, "block_size": 4,
                                               **getattr(request, "param", {})},
                      optim={"total_steps": 3})
    assert run_single_process(config_from_dict(raw)) == 0
    out = tmp_path / "export"
    assert export_main(["--checkpoint", str(tmp_path / "run"), "--out", str(out), "--dtype", "float32"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["out"] == str(out)
    return latest_checkpoint(tmp_path / "run"), out, load_target(tiny_target)


def block_inputs(target, drafter_cfg, n_context: int = 11):
    torch.manual_seed(1)
    context = torch.randn(n_context, drafter_cfg.num_target_features * drafter_cfg.hidden_size)
    block_ids = torch.full((drafter_cfg.block_size,), drafter_cfg.mask_token_id)
    block_ids[0] = 7
    positions = torch.arange(n_context + drafter_cfg.block_size)
    return context, block_ids, positions


@pytest.mark.parametrize("exported", [{}, SLIDING], indirect=True, ids=["full", "sliding"])
def test_the_export_reloads_to_the_checkpoints_block_logits_exactly(exported):
    checkpoint, out, target = exported
    trained, layer_ids = load_drafter(checkpoint, target)
    reloaded, exported_ids = load_export(out, target)
    assert exported_ids == layer_ids and reloaded.cfg == trained.cfg
    context, block_ids, positions = block_inputs(target, trained.cfg)
    n = context.shape[0]
    mask = build_block_attention_mask(torch.zeros(n, dtype=torch.long), positions[:n],
                                      torch.zeros(1, dtype=torch.long), torch.tensor([n]),
                                      trained.cfg.block_size)
    with torch.no_grad():
        want = trained.logits(trained(context, positions[:n], block_ids, positions[n:], mask))
        got = reloaded.logits(reloaded(context, positions[:n], block_ids, positions[n:], mask))
    assert torch.equal(got, want)

    # The same logits from a DFlashDraftModel-shaped stack of transformers' Qwen3 parts that knows
    # only config.json and loads model.safetensors strictly by name.
    config = Qwen3Config.from_pretrained(out)
    assert config.architectures == ["DFlashDraftModel"] and config.num_hidden_layers == 2
    assert config.dflash_config == {"block_size": 4, "mask_token_id": trained.cfg.mask_token_id,
                                    "target_layer_ids": layer_ids}
    assert config.num_target_layers == target.config.num_hidden_layers
    assert getattr(config, "is_causal", None) is None  # each engine's per-layer default is what was trained
    assert config.layer_types == trained.cfg.layer_types
    assert config.sliding_window == trained.cfg.sliding_window
    reference = ReferenceDrafter(config)
    reference.load_state_dict(load_file(str(out / "model.safetensors")), strict=True)
    with torch.no_grad():
        embedded = target.get_input_embeddings()(block_ids)[None]
        hidden = reference(context[None], embedded, positions[None])
        reference_logits = target.get_output_embeddings()(hidden)[0]
    torch.testing.assert_close(reference_logits, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(reference_logits.argmax(-1), want.argmax(-1))


def test_the_default_export_is_bf16_with_the_rope_base_both_ways_its_code_and_a_serving_readme(
        exported, tmp_path):
    checkpoint, fp32_dir, target = exported
    out = tmp_path / "bf16"
    assert export_main(["--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    weights = load_file(str(out / "model.safetensors"))
    fp32_weights = load_file(str(fp32_dir / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert all(torch.equal(weights[name], t.to(torch.bfloat16)) for name, t in fp32_weights.items())

    config = json.loads((out / "config.json").read_text())
    theta = target.config.rope_parameters["rope_theta"]
    assert config["dtype"] == "bfloat16"
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": theta}
    assert (config["rope_theta"], config["rope_scaling"]) == (theta, None)  # what transformers 4 reads
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    for name in ("modeling_dflash.py", "drafter.py"):  # the code auto_map names, as this package has it
        assert (out / name).read_text() == (REPO / "dflash_ops" / "model" / name).read_text()

    readme = (out / "README.md").read_text()
    block_size = config["dflash_config"]["block_size"]
    assert f'"num_speculative_tokens": {block_size - 1}' in readme and f'"model": "{out}"' in readme
    assert "--speculative-algorithm DFLASH" in readme and "trust_remote_code=True" in readme
    # Each engine's count: SGLang's flag is the block size, vLLM's and TensorRT-LLM's one less.
    assert f"--speculative-num-draft-tokens {block_size}" in readme
    assert f"max_draft_len: {block_size - 1}" in readme
    assert f"mask token {config['dflash_config']['mask_token_id']}" in readme


@pytest.mark.parametrize("exported", [{}, SLIDING], indirect=True, ids=["full", "sliding"])
def test_the_export_says_which_layers_slide_in_the_keys_the_readers_take(exported, tmp_path):
    checkpoint, out, target = exported
    config = json.loads((out / "config.json").read_text())
    keys = ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers")
    assert "is_causal" not in config  # an explicit value overrides every layer's type in current engines
    sliding = load_drafter(checkpoint, target)[0].cfg.sliding_window is not None
    if sliding:
        assert {key: config[key] for key in keys} == {
            "layer_types": SLIDING["layer_types"], "use_sliding_window": True, "sliding_window": 6,
            "max_window_layers": 0}
        readme = (out / "README.md").read_text()
        assert "the sliding_attention layers have a window of 6 tokens" in readme
        assert "VLLM_USE_V2_MODEL_RUNNER=1" in readme  # vLLM needs it for mixed layer types
    else:
        assert {key: config[key] for key in keys} == {
            "layer_types": ["full_attention"] * 2, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": 2}
    # Without use_sliding_window, Qwen3Config drops the window: such a directory is refused, not
    # served with full attention.
    edited = tmp_path / "edited"
    shutil.copytree(out, edited)
    (edited / "config.json").write_text(json.dumps({**config, "use_sliding_window": False}))
    assert Qwen3Config.from_pretrained(edited).sliding_window is None
    if sliding:
        with pytest.raises(ValueError, match="no sliding_window: it needs .* use_sliding_window: true"):
            load_export(edited, target)


def test_a_checkpoint_whose_mask_is_a_stop_token_exports_with_a_warning(exported, make_target, tmp_path,
                                                                        capsys):
    checkpoint, _, _ = exported
    old = tmp_path / "old-checkpoint"
    shutil.copytree(checkpoint, old)
    meta = json.loads((old / "meta.json").read_text())
    mask = meta["drafter_config"]["mask_token_id"]
    # The same target, as a release whose eos is the token the checkpoint was trained to mask with.
    meta["target_path"] = str(make_target("eos-is-mask", eos_token_id=mask))
    (old / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert export_main(["--checkpoint", str(old), "--out", str(tmp_path / "out")]) == 0
    (warning,) = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    assert warning["event"] == "warning"
    assert f"{mask} is the target's config.json eos_token_id" in warning["message"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] == mask  # the mask the weights learnt


def test_export_of_a_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert export_main(["--checkpoint", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
