"""Each layer of an export attends as the trainer trained it, under every engine's rule for reading
causality from config.json.

The trainer's side comes from its own mask (`build_block_attention_mask`): a full layer lets a block's
first position see the next one (non-causal inside the block), a sliding layer does not (causal, the
window p-W < k <= p). Each engine's side is its rule, written here from its source, applied to the
exported config.json. An explicit `is_causal` overrides every layer in the current engines, so an
export with a sliding layer must not carry one (an export that wrote `is_causal: false` failed here for
vLLM after PR 52816, SGLang after PR 34524 and z-lab's class).
"""

from __future__ import annotations

import pytest
import torch

from dflash_ops.model.drafter import DrafterConfig
from dflash_ops.model.loss import build_block_attention_mask
from dflash_ops.serve.export import drafter_hf_config

BLOCK = 4
TARGET = {"model_type": "qwen3", "num_hidden_layers": 4, "max_position_embeddings": 64}


def trained_causal(layer_type: str, window: int) -> bool:
    """Whether the trainer's mask of a layer of this type hides a block's next position from its first."""
    context = torch.zeros(8, dtype=torch.int64)  # one document: 8 context tokens, one block at anchor 8
    mask = build_block_attention_mask(context, torch.arange(8), torch.zeros(1, dtype=torch.int64),
                                      torch.tensor([8]), BLOCK,
                                      window if layer_type == "sliding_attention" else None)
    return not bool(mask[0, 8 + 1])


# vLLM before PR 52816, vllm/model_executor/models/qwen3_dflash.py `_dflash_layer_causal`:
# `dflash_config.causal` overrides all layers, else only sliding (SWA) layers are causal.
def vllm_before_52816(config: dict, i: int) -> bool:
    override = (config.get("dflash_config") or {}).get("causal")
    if override is not None:
        return bool(override)
    return bool(config.get("layer_types")) and config["layer_types"][i] == "sliding_attention"


# vLLM since PR 52816, the same function: a top-level `is_causal`, then `dflash_config.is_causal`, then
# the legacy `dflash_config.causal`, then the layer's type.
def vllm_since_52816(config: dict, i: int) -> bool:
    dflash = config.get("dflash_config") or {}
    explicit = config.get("is_causal", dflash.get("is_causal"))
    return bool(explicit) if explicit is not None else vllm_before_52816(config, i)


# SGLang before PR 34524, python/sglang/srt/models/dflash.py: a sliding layer is DECODER (causal, window
# left W-1), a full layer ENCODER_ONLY (both ways); `is_causal` is not read.
def sglang_before_34524(config: dict, i: int) -> bool:
    return config["layer_types"][i] == "sliding_attention"


# SGLang since PR 34524, `_get_dflash_layer_attention_params` and `_get_dflash_attention_type`: the
# layer's type gives the default (full ENCODER_ONLY, sliding DECODER); an explicit `is_causal` replaces it
# (true DECODER, false ENCODER_ONLY, a two-sided window for a sliding layer).
def sglang_since_34524(config: dict, i: int) -> bool:
    explicit = config.get("is_causal")
    return sglang_before_34524(config, i) if explicit is None else bool(explicit)


# z-lab/dflash dflash/model.py `Qwen3DFlashAttention.__init__`: `is_causal` when set, else
# `layer_type == "sliding_attention"`; its non-causal sliding mask is symmetric (|q - k| < W).
def zlab(config: dict, i: int) -> bool:
    layer_type = config["layer_types"][i] if config.get("layer_types") else "full_attention"
    explicit = config.get("is_causal")
    return layer_type == "sliding_attention" if explicit is None else bool(explicit)


# TensorRT-LLM tensorrt_llm/_torch/models/modeling_dflash.py: a sliding layer attends causally with the
# window (W-1, 0), a full layer both ways; `is_causal` is read by DFlash 2 drafters only.
def tensorrt_llm(config: dict, i: int) -> bool:
    return config["layer_types"][i] == "sliding_attention"


ENGINES = {"vLLM before PR 52816": vllm_before_52816, "vLLM since PR 52816": vllm_since_52816,
           "SGLang before PR 34524": sglang_before_34524, "SGLang since PR 34524": sglang_since_34524,
           "z-lab Qwen3DFlashAttention": zlab, "TensorRT-LLM modeling_dflash": tensorrt_llm}
LAYOUTS = {"full": ["full_attention"] * 2, "sliding": ["sliding_attention"] * 2,
           "mixed": ["sliding_attention", "full_attention", "sliding_attention"]}


def exported_config(layer_types: list[str]) -> dict:
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=16, num_layers=len(layer_types), num_target_features=2, block_size=BLOCK,
                        mask_token_id=99, vocab_size=100, layer_types=list(layer_types),
                        sliding_window=3 if "sliding_attention" in layer_types else None)
    return drafter_hf_config(cfg, [1, 2], TARGET, "bfloat16")


def test_the_trainer_trains_full_layers_both_ways_and_sliding_layers_causally():
    assert trained_causal("full_attention", 3) is False
    assert trained_causal("sliding_attention", 3) is True


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_engine_resolves_each_exported_layer_as_it_was_trained(engine, layout):
    config = exported_config(LAYOUTS[layout])
    served = [ENGINES[engine](config, i) for i in range(config["num_hidden_layers"])]
    trained = [trained_causal(t, config["sliding_window"] or 3) for t in config["layer_types"]]
    assert served == trained, f"{engine} serves layers {config['layer_types']} as causal={served}"


def test_an_explicit_is_causal_false_is_what_breaks_a_sliding_drafter():
    """The rules above are not blind to the key: with `is_causal: false` the current engines serve a
    sliding layer both ways, which it never saw in training."""
    config = {**exported_config(LAYOUTS["sliding"]), "is_causal": False}
    for engine in ("vLLM since PR 52816", "SGLang since PR 34524", "z-lab Qwen3DFlashAttention"):
        assert ENGINES[engine](config, 0) is False
