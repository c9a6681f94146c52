"""The transformers class of an exported drafter: `AutoModel.from_pretrained(dir, trust_remote_code=True)`.

`python -m dflash_ops.export` copies this file and `drafter.py` (the layers it was trained with) into the
export directory and names the class in config.json's `auto_map`. It runs under transformers 4.x
(the public DFlash code pins 4.57.1) and 5.x, and imports nothing of this package but `.drafter`
(the relative import is what lets it run from the export directory, where `dflash_ops` is not installed).

The model holds the trained weights only (`fc`, `hidden_norm`, `layers.*`, `norm`): the block's
embedding and the logits come from the target's own embedding and lm_head. `spec_generate` is the
call the public code documents (`draft.spec_generate(input_ids=..., max_new_tokens=...,
temperature=0.0, target=target, stop_token_ids=[...])`): greedy speculative decoding that returns
the target's own greedy output. It keeps no KV cache (every verify step runs the target over the
whole sequence): a check that the drafter works, not a server; engines serve it fast.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, Qwen3Config

from .drafter import SLIDING_ATTENTION, DrafterConfig, DraftStack, rope_theta_of


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
        layer_types=list(config.layer_types), sliding_window=sliding_window_of(config),
    )


def sliding_window_of(config) -> int | None:
    """The window of the sliding_attention layers (None without any)."""
    if SLIDING_ATTENTION not in config.layer_types:
        return None
    if config.sliding_window is None:  # Qwen3Config keeps it only with use_sliding_window
        raise ValueError(f"config.json has sliding_attention layers ({config.layer_types}) but no "
                         "sliding_window: it needs sliding_window and use_sliding_window: true")
    return config.sliding_window


class DFlashDraftModel(DraftStack, PreTrainedModel):
    """A DFlash drafter: given the target's hidden states of the context and the embedded block
    `[anchor, mask, ..., mask]`, the hidden states of the block after the final norm."""

    # config.json's model_type is qwen3 (what engines read); AutoModel refuses a class registered
    # for another config class.
    config_class = Qwen3Config
    _no_split_modules = ["DraftLayer"]  # device_map="auto" keeps each layer on one device

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

    @torch.no_grad()
    def spec_generate(self, target, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                      stop_token_ids: list[int] | None = None) -> torch.Tensor:
        """`input_ids` `[1, P]` and the target's greedy continuation, `[1, P + n]` (n <= max_new_tokens,
        ending at the first stop token). Each step drafts a block after the newest token, and the
        target keeps the drafted tokens up to its first disagreement, then adds its own next token."""
        if temperature:
            raise ValueError("spec_generate here is greedy only: pass temperature=0.0")
        if input_ids.shape[0] != 1:
            raise ValueError(f"spec_generate takes one sequence, got a batch of {input_ids.shape[0]}")
        layer_ids = self.config.dflash_config["target_layer_ids"]
        block_size, stops = self.cfg.block_size, set(stop_token_ids or [])
        device = input_ids.device

        def run_target(tokens: list[int]) -> tuple[list[int], torch.Tensor]:
            """The target's greedy next token after each position, and its features `[len, k*H]`."""
            out = target(input_ids=torch.tensor([tokens], device=device), output_hidden_states=True)
            features = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
            return out.logits[0].argmax(-1).tolist(), features

        tokens = input_ids[0].tolist()
        prompt_len = len(tokens)
        predicted, features = run_target(tokens)
        tokens.append(predicted[-1])
        while len(tokens) - prompt_len < max_new_tokens and tokens[-1] not in stops:
            anchor = len(tokens) - 1  # the newest token: the target has not seen it yet
            block = torch.tensor([tokens[-1]] + [self.cfg.mask_token_id] * (block_size - 1), device=device)
            positions = torch.arange(anchor + block_size, device=device)[None]
            hidden = self(features[None, :anchor], target.get_input_embeddings()(block)[None], positions)
            head = target.get_output_embeddings()
            drafted = head(hidden[0, 1:].to(head.weight.dtype)).argmax(-1).tolist()
            predicted, features = run_target(tokens + drafted)
            kept = 0
            while kept < len(drafted) and drafted[kept] == predicted[anchor + kept]:
                kept += 1
            tokens += drafted[:kept] + [predicted[anchor + kept]]
        generated = tokens[prompt_len:prompt_len + max_new_tokens]
        for i, token in enumerate(generated):
            if token in stops:
                generated = generated[:i + 1]
                break
        return torch.tensor([tokens[:prompt_len] + generated], device=device)
