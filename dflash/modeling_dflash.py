"""The transformers class of an exported drafter: `AutoModel.from_pretrained(dir, trust_remote_code=True)`.

`python -m dflash.export` copies this file and `model.py` (the layers it was trained with) into the
export directory and names the class in config.json's `auto_map`. It runs under transformers 4.x
(the public DFlash code pins 4.57.1) and 5.x, and imports nothing of this package but `.model`
(the relative import is what lets it run from the export directory, where `dflash` is not installed).

The model holds the trained weights only (`fc`, `hidden_norm`, `layers.*`, `norm`): the block's
embedding and the logits come from the target's own embedding and lm_head.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, Qwen3Config

from .model import DrafterConfig, DraftStack, rope_theta_of


def drafter_config_from_hf(config) -> DrafterConfig:
    """The drafter's shapes from an exported config.json (as a transformers config)."""
    dflash = config.dflash_config
    return DrafterConfig(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, num_layers=config.num_hidden_layers,
        num_target_features=len(dflash["target_layer_ids"]), block_size=dflash["block_size"],
        mask_token_id=dflash["mask_token_id"], vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps, rope_theta=rope_theta_of(config),
    )


class DFlashDraftModel(DraftStack, PreTrainedModel):
    """A DFlash drafter: given the target's hidden states of the context and the embedded block
    `[anchor, mask, ..., mask]`, the hidden states of the block after the final norm."""

    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DraftLayer"]

    def __init__(self, config: Qwen3Config):
        PreTrainedModel.__init__(self, config)
        self.init_draft_stack(drafter_config_from_hf(config))
        self.post_init()

    def forward(self, target_hidden: torch.Tensor, noise_embedding: torch.Tensor,
                position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`target_hidden` `[B, T, k*H]`: the target's layers `dflash_config.target_layer_ids`
        (hidden_states[id + 1]) concatenated, for context positions 0..T-1; `noise_embedding`
        `[B, b, H]`: the target's embedding of the block; `position_ids` `[B, T+b]`: the context's
        positions, then the block's. `attention_mask` `[b, T+b]` (True = may attend; default:
        the block sees the whole context and itself). Returns `[B, b, H]`; the target's lm_head
        makes the logits."""
        n_context = target_hidden.shape[1]
        rows = [self.draft_hidden(target_hidden[i], position_ids[i, :n_context], noise_embedding[i],
                                  position_ids[i, n_context:], attention_mask)
                for i in range(target_hidden.shape[0])]
        return torch.stack(rows)
