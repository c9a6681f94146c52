"""Document attention for a packed target pass: the documents of a batch concatenated into one row,
each attending only to itself, so that no padding token is computed.

`packed_documents(model, bounds)` runs the target's attention layers, for the pass inside it, through
`document_attention` (registered with transformers' `AttentionInterface` under `DOCUMENTS`): each
document's slice of the packed queries, keys and values goes through transformers' own SDPA
function (`sdpa_attention_forward`) exactly as that document alone would (causal, no mask, the same
GQA handling), and the outputs are joined. The positions restart at 0 in every document (the caller's
`position_ids`), so RoPE sees what it sees for the document alone. No `[T, T]` mask is built:
the name has no mask function registered, so transformers' mask creation returns None for it.

On CPU every matrix product of the pass is one product over the packed tokens and each attention
one document's, so the features equal bit for bit those of each document captured alone (tests).
Against the padded batch of the same documents they agree to rounding only: there the attention of
a shorter row reduces over the padded key length (masked keys included: the CPU flash kernel's key
blocks are min(512, Lmax) long and its exp-sums and P.V products run over the whole block), so a
document's padded features depend on its batch's longest row; the packed ones do not.

On CUDA the same per-document SDPA calls run the flash kernel per document (one launch per document
and layer); a varlen or FlexAttention document-mask kernel would make it one launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import nn

DOCUMENTS = "dflash_documents"
BOUNDS = "document_bounds"


def document_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over one packed row `[1, heads, T, d]`: SDPA per
    document of `kwargs[BOUNDS]` (token offsets 0 = b0 < b1 < ... = T), outputs `[1, T, heads, d]`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = kwargs.pop(BOUNDS, None)
    if bounds is None or attention_mask is not None or query.shape[0] != 1:
        raise ValueError(f"{DOCUMENTS} attention runs one packed row with its {BOUNDS} and no mask")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{DOCUMENTS} attention has no sliding window")
    kwargs.pop("position_ids", None)
    spans = [(start, end) for start, end in zip(bounds[:-1], bounds[1:], strict=True) if end > start]
    output = None
    for start, end in spans:
        part = sdpa_attention_forward(module, query[:, :, start:end], key[:, :, start:end],
                                      value[:, :, start:end], None, **kwargs)[0]
        if len(spans) == 1:
            return part, None
        if output is None:  # [1, T, heads, d], each document's rows written as they come (no list to join)
            output = part.new_empty(1, query.shape[2], *part.shape[2:])
        output[:, start:end] = part
        del part
    return output, None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(DOCUMENTS, document_attention)


def packable(model: nn.Module) -> bool:
    """Whether `model` (a transformers decoder) can run packed documents here: SDPA attention, every
    layer full attention (a sliding window would need its own per-document mask)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", DOCUMENTS):
        return False
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return all(kind == "full_attention" for kind in layer_types) and not getattr(config, "use_sliding_window",
                                                                               False)


@contextmanager
def packed_documents(model: nn.Module, bounds: Sequence[int]):
    """Inside: `model`'s attention is `document_attention`; yields the keyword arguments its forward
    takes for a packed row of documents at `bounds` (the caller passes `position_ids` restarting at 0
    in each document)."""
    _register()
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and hasattr(c, "_attn_implementation")}
    before = {key: c._attn_implementation for key, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = DOCUMENTS
        yield {BOUNDS: tuple(int(b) for b in bounds)}
    finally:
        for key, c in configs.items():
            c._attn_implementation = before[key]
