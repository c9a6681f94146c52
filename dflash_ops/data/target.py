"""The frozen target: loading it from a local directory and capturing k of its hidden layers.

A drafter rank needs only what the drafter borrows from the target (`TargetHead`: its config,
its frozen input embedding and lm_head); `load_target_head` reads those two tensors from the
target's safetensors without building the model, so a drafter GPU never holds the decoder layers.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dflash_ops.core.runtime import readable
from dflash_ops.data.document_attention import packable, packed_documents
from dflash_ops.data.examples import Example
from dflash_ops.model.hidden_states import PackedHiddenStates, get_hidden_states_packed, packing_metadata

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_target(path: str | Path, dtype: str = "float32", device: str | torch.device = "cpu") -> nn.Module:
    """Load a causal LM saved with `save_pretrained` at a local `path`, frozen and in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the run's log is JSON lines; no loading bars in it
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no model at {path} (expected {path / 'config.json'})")
    for weights in sorted(path.glob("*.safetensors")):
        readable(weights)  # a file the run may not read says so (transformers reads it through safetensors)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype], local_files_only=True)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


@dataclass
class TargetHead:
    """What the drafter borrows from the target: its config, frozen input embedding and lm_head."""

    config: object  # the transformers config of the target
    embed_tokens: nn.Embedding
    lm_head: nn.Linear

    @classmethod
    def of(cls, target: nn.Module) -> TargetHead:
        """The head of a loaded target (shared, not copied)."""
        return cls(target.config, target.get_input_embeddings(), target.get_output_embeddings())


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or the shards of an index)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no safetensors weights at {path} (expected {single} or {index})")
    with safe_open(readable(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _read_tensor(files: dict[str, Path], name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(readable(files[name]), framework="pt") as f:
        return f.get_tensor(name)


def load_target_head(path: str | Path, dtype: str = "float32",
                     device: str | torch.device = "cpu") -> TargetHead:
    """The target's config, input embedding and lm_head, read from its safetensors (only those two
    tensors are read; the model is never built), frozen, in `dtype` on `device`."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no model at {path} (expected {path / 'config.json'})")
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    files = _weight_files(path)
    embed_names = [name for name in files if name.endswith("embed_tokens.weight")]
    if len(embed_names) != 1:
        raise ValueError(f"expected one input embedding (*embed_tokens.weight) in {path}, "
                         f"found {embed_names}")
    embed_weight = _read_tensor(files, embed_names[0]).to(device=device, dtype=DTYPES[dtype])
    embed = nn.Embedding.from_pretrained(embed_weight, freeze=True)
    lm_head = nn.Linear(embed_weight.shape[1], embed_weight.shape[0], bias=False, device="meta")
    if getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in files:
        lm_head.weight = embed.weight  # tied: one tensor, as in the model
    else:
        head_weight = _read_tensor(files, "lm_head.weight").to(device=device, dtype=DTYPES[dtype])
        lm_head.weight = nn.Parameter(head_weight, requires_grad=False)
    return TargetHead(config, embed, lm_head)


class _DeepestLayerDone(Exception):
    """Raised by the capture hook of the deepest layer needed: the layers after it never run."""


@contextmanager
def _layer_capture(target: nn.Module, layer_ids: list[int], features: torch.Tensor):
    """Forward hooks that copy each selected layer's output into its column of `features` `[T, k, H]`
    as the target produces it, the deepest one ending the pass (`_DeepestLayerDone`). Yields the
    pass's destination, a dict the caller sets per pass: `out`, the rows of `features` the pass
    writes, and `index`, the flat positions of its real tokens in the layer output (None: all)."""
    base = target.base_model
    n_layers = len(base.layers)
    columns: dict[int, list[int]] = {}
    for column, layer_id in enumerate(layer_ids):
        columns.setdefault(layer_id, []).append(column)
    deepest = max(layer_ids)
    width = features.shape[-1]
    rows: dict = {"index": None, "out": features}

    def capture(layer_id: int):
        def hook(module, args, output):
            hidden = (output[0] if isinstance(output, tuple) else output).reshape(-1, width)
            for column in columns[layer_id]:
                if rows["index"] is None:
                    rows["out"][:, column].copy_(hidden)
                else:
                    torch.index_select(hidden, 0, rows["index"], out=rows["out"][:, column])
            if layer_id == deepest:
                raise _DeepestLayerDone
        return hook

    # transformers' hidden_states[-1] (the last layer) is the final norm's output.
    modules = {i: base.norm if i == n_layers - 1 else base.layers[i] for i in columns}
    handles = [modules[i].register_forward_hook(capture(i)) for i in columns]
    try:
        yield rows
    finally:
        for handle in handles:
            handle.remove()


def _check_layer_ids(target: nn.Module, layer_ids: list[int]) -> None:
    n_layers = len(target.base_model.layers)
    for layer_id in layer_ids:
        if not 0 <= layer_id < n_layers:
            raise ValueError(f"layer id {layer_id} out of range for a target with {n_layers} layers")


def _run_to_deepest(base: nn.Module, **inputs) -> None:
    try:
        base(use_cache=False, **inputs)
    except _DeepestLayerDone:
        pass


@torch.no_grad()
def target_hidden_states(
    target: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int],
    rows_per_pass: int | None = None,
) -> PackedHiddenStates:
    """The selected layers' real tokens of a padded batch, packed `[T, k*H]`, captured as the
    target produces them: a forward hook on each selected layer copies its output's real tokens
    into that layer's slice of the output, and the hook of the deepest one ends the forward pass.
    No layer past the deepest runs, no lm_head, and no other layer's output is kept: the peak is
    the packed output plus one layer's working set, not the n + 1 `[B, L, H]` tensors of
    `output_hidden_states`. `rows_per_pass` runs the batch that many rows at a time (same padded
    length), which divides the working set accordingly.

    Bit-identical to `target_hidden_states_all_layers`, including its last layer, which
    transformers reports after the final norm (with `rows_per_pass` on CPU, as the tests check;
    a GPU's matrix kernels may round a smaller batch differently). The padding is computed:
    `target_document_states` is the capture that computes none."""
    _check_layer_ids(target, layer_ids)
    base = target.base_model
    cu_seqlens, position_ids, token_index = packing_metadata(attention_mask)
    features = torch.empty(token_index.numel(), len(layer_ids), target.config.hidden_size,
                           dtype=base.embed_tokens.weight.dtype, device=input_ids.device)
    n_rows = input_ids.shape[0]
    step = min(rows_per_pass or n_rows, n_rows)
    with _layer_capture(target, layer_ids, features) as rows:
        for first in range(0, n_rows, step):
            last = min(first + step, n_rows)
            mask = attention_mask[first:last]
            rows["index"] = mask.reshape(-1).nonzero().squeeze(1)
            rows["out"] = features[int(cu_seqlens[first]): int(cu_seqlens[last])]
            if rows["index"].numel():
                _run_to_deepest(base, input_ids=input_ids[first:last], attention_mask=mask)
    return PackedHiddenStates(features.view(features.shape[0], -1), cu_seqlens, position_ids, token_index)


def document_metadata(lengths: Sequence[int], device: torch.device | str = "cpu"):
    """(cu_seqlens, position_ids, token_index) of documents of `lengths`, as `packing_metadata` gives
    them for the right-padded batch of those documents (`collate`), without building that batch."""
    lengths = [int(n) for n in lengths]
    max_len = max(lengths, default=0)
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    position_ids = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths]) if lengths else \
        torch.zeros(0, dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int64), torch.tensor(lengths))
    token_index = rows * max_len + position_ids
    return cu_seqlens.to(device), position_ids.to(device), token_index.to(device)


@torch.no_grad()
def target_document_states(
    target: nn.Module, input_ids: torch.Tensor, lengths: Sequence[int], layer_ids: list[int],
    rows_per_pass: int | None = None,
) -> PackedHiddenStates:
    """The selected layers' features of documents packed end to end (`input_ids` `[T]`, document d
    the next `lengths[d]` tokens), `[T, k*H]`, computing no padding: each pass runs its documents as
    one row, positions restarting at 0 in each document and attention within each document only
    (`dflash_ops.data.document_attention`), captured by the same hooks as `target_hidden_states`.
    `rows_per_pass` documents a pass (all by default). The metadata is that of `collate`'s padded
    batch of the same documents (`document_metadata`).

    On CPU bit-equal to `target_hidden_states` of each document alone (a batch of one, no padding);
    against the padded batch of all of them, equal to rounding (the padded attention of a shorter row
    reduces over the padded length: `dflash_ops.data.document_attention`). A target that cannot pack
    (attention other than SDPA, sliding-window layers) runs the padded batch instead."""
    _check_layer_ids(target, layer_ids)
    lengths = [int(n) for n in lengths]
    if sum(lengths) != input_ids.numel():
        raise ValueError(f"documents of {sum(lengths)} tokens in all, input_ids has {input_ids.numel()}")
    base = target.base_model
    if not packable(base):
        return _padded_documents(target, input_ids, lengths, layer_ids, rows_per_pass)
    device = input_ids.device
    cu_seqlens, position_ids, token_index = document_metadata(lengths, device)
    offsets = [0, *itertools.accumulate(lengths)]
    features = torch.empty(offsets[-1], len(layer_ids), target.config.hidden_size,
                           dtype=base.embed_tokens.weight.dtype, device=device)
    n_docs = len(lengths)
    step = min(rows_per_pass or n_docs, n_docs) if n_docs else 1
    with _layer_capture(target, layer_ids, features) as rows:
        for first in range(0, n_docs, step):
            last = min(first + step, n_docs)
            start, end = offsets[first], offsets[last]
            if end == start:
                continue
            rows["out"] = features[start:end]
            bounds = [offset - start for offset in offsets[first: last + 1]]
            with packed_documents(base, bounds) as attention:
                _run_to_deepest(base, input_ids=input_ids[None, start:end],
                                position_ids=position_ids[None, start:end], **attention)
    return PackedHiddenStates(features.view(features.shape[0], -1), cu_seqlens, position_ids, token_index)


def _padded_documents(target, input_ids, lengths, layer_ids, rows_per_pass) -> PackedHiddenStates:
    """`target_document_states` through the padded batch (`collate`'s layout)."""
    max_len = max(lengths, default=0)
    padded = input_ids.new_zeros(len(lengths), max_len)
    mask = torch.zeros(len(lengths), max_len, dtype=torch.int64, device=input_ids.device)
    offsets = [0, *itertools.accumulate(lengths)]
    for row, n in enumerate(lengths):
        padded[row, :n] = input_ids[offsets[row]: offsets[row] + n]
        mask[row, :n] = 1
    return target_hidden_states(target, padded, mask, layer_ids, rows_per_pass)


def step_features(target: nn.Module, examples: list[Example], layer_ids: list[int],
                  rows_per_pass: int | None, device: torch.device) -> dict[str, torch.Tensor]:
    """What one drafter step takes from a batch of `examples`, computed by `target` on `device`:
    the packed `[T, k*H]` features of `layer_ids` with their `cu_seqlens` and `position_ids`, and
    the batch's `input_ids` and `loss_mask` packed the same way (the keyword arguments of
    `DrafterTrainer.train_step` and of `dflash_ops.run.transport.send_batch`). The documents run
    packed (`target_document_states`): no padding is computed."""
    input_ids = torch.cat([e.input_ids for e in examples]).to(device)
    packed = target_document_states(target, input_ids, [e.input_ids.numel() for e in examples], layer_ids,
                                    rows_per_pass)
    return {"features": packed.features, "cu_seqlens": packed.cu_seqlens, "position_ids": packed.position_ids,
            "input_ids": input_ids, "loss_mask": torch.cat([e.loss_mask for e in examples]).to(device)}


@torch.no_grad()
def target_hidden_states_all_layers(
    target: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int]
) -> PackedHiddenStates:
    """Reference path: every layer's output through `output_hidden_states`, then the selected
    layers packed. Holds n + 1 `[B, L, H]` tensors and runs every layer."""
    output = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                    use_cache=False, logits_to_keep=1)
    return get_hidden_states_packed(output.hidden_states, layer_ids, attention_mask)
