"""The frozen target: loading it from a local directory and capturing k of its hidden layers."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dflash.hidden_states import PackedHiddenStates, get_hidden_states_packed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_target_layer_ids(n_target_layers: int, n_draft_layers: int) -> list[int]:
    """Target layers whose hidden states condition the drafter: one per draft layer, uniformly
    spaced from layer 1 to layer n-3 (36 layers, 5 draft layers: 1, 9, 17, 25, 33); the middle
    layer for a single draft layer. On shallow targets the span widens (up to layer n-1) so that
    the ids stay distinct where the depth allows."""
    if n_target_layers < 1 or n_draft_layers < 1:
        raise ValueError(f"need at least one target and one draft layer, "
                         f"got {n_target_layers} and {n_draft_layers}")
    if n_draft_layers == 1:
        return [n_target_layers // 2]
    start = min(1, n_target_layers - 1)
    end = min(n_target_layers - 1, max(n_target_layers - 3, start + n_draft_layers - 1))
    span = end - start
    return [round(start + i * span / (n_draft_layers - 1)) for i in range(n_draft_layers)]


def load_target(path: str | Path, dtype: str = "float32", device: str | torch.device = "cpu") -> nn.Module:
    """Load a causal LM saved with `save_pretrained` at a local `path`, frozen and in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the run's log is JSON lines; no loading bars in it
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no model at {path} (expected {path / 'config.json'})")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype], local_files_only=True)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def resolve_mask_token_id(configured: int | None, target_path: str | Path, vocab_size: int) -> int:
    """The configured mask token, else the tokenizer's mask or pad token, else vocab_size - 1."""
    if configured is not None:
        if not 0 <= configured < vocab_size:
            raise ValueError(f"model.mask_token_id {configured} is outside the vocabulary "
                             f"(size {vocab_size})")
        return configured
    path = Path(target_path)
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        for token_id in (tokenizer.mask_token_id, tokenizer.pad_token_id):
            if token_id is not None and 0 <= token_id < vocab_size:
                return int(token_id)
    return vocab_size - 1


@torch.no_grad()
def target_hidden_states(
    target: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int]
) -> PackedHiddenStates:
    """Run the target on a padded batch and return the selected layers' real tokens, packed."""
    output = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                    use_cache=False, logits_to_keep=1)
    return get_hidden_states_packed(output.hidden_states, layer_ids, attention_mask)
