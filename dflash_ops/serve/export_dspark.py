"""A DSpark drafter's export (`model.kind: dspark`), in the layout vLLM's Qwen3 DSpark loader reads.

`dflash_ops.serve.export.export_checkpoint` writes a DSpark checkpoint as it writes a DFlash one (the DFlash
backbone's weights under the same names, `model.safetensors`, `SHA256SUMS`), with:
- `config.json`: the DFlash config (`drafter_hf_config`) with `architectures: ["Qwen3DSparkModel"]`
  (the architecture vLLM's registry maps to `Qwen3DSparkForCausalLM`; third-party reports say a bare
  `DSparkDraftModel` is routed to vLLM's DeepSeek-V4 path by some versions), no `auto_map` (the shipped
  `modeling_dflash.py` is DFlash's and knows no Markov head), `markov_rank`, `markov_head_type: vanilla`,
  `enable_confidence_head`, `confidence_head_with_markov`, `draft_vocab_size` (the target's vocabulary:
  no reduced vocabulary, so no `d2t`), `sample_from_anchor: true` (the block's first position predicts the
  token after the anchor, as trained: vLLM's `DSparkSpeculator` reads it, true when absent; false would
  be the DFlash layout of 1 + N positions), and `mask_token_id` / `target_layer_ids` at the top level as
  well as in `dflash_config`;
- the heads' weights: `markov_head.markov_w1.weight` `[vocab, rank]`, `markov_head.markov_w2.weight`
  `[vocab, rank]`, and `confidence_head.proj.{weight,bias}` (`[1, hidden (+ rank)]`, `[1]`) when trained.

What vLLM does with them (vllm-project/vllm `vllm/model_executor/models/qwen3_dspark.py` at
0302ff40439493d0db2e3bbfd509211703375d08, `Qwen3DSparkForCausalLM.load_weights`): every name but
`lm_head` gets the prefix `model.`; names with `t2d` are skipped and `d2t` becomes `draft_id_to_target_id`;
`mask_embedding` is dropped, `embed_tokens` / `lm_head` / `draft_id_to_target_id` are dropped when the
checkpoint has none (shared from the target), and the confidence head is dropped (set to None) when the
config does not enable it or the checkpoint has none. `vllm_loaded_names` replays that mapping;
`dspark_weight_name_problem` checks its result against the parameters vLLM's model declares (the DFlash
backbone's, `DFlashQwen3Model`, under `model.`, plus the heads of `Qwen3DSparkModel.__init__`).
"""

from __future__ import annotations

import torch

DSPARK_ARCHITECTURE = "Qwen3DSparkModel"
MARKOV_W1, MARKOV_W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
CONFIDENCE = ("confidence_head.proj.weight", "confidence_head.proj.bias")


def is_dspark_state(state: dict) -> bool:
    """Whether a checkpoint's weights are a DSpark drafter's (they hold the Markov head)."""
    return MARKOV_W1 in state


def dspark_hf_config(config: dict, state: dict[str, torch.Tensor]) -> dict:
    """The config.json of a DSpark export: the DFlash export's `config`, its heads read off `state`."""
    rank = int(state[MARKOV_W1].shape[1])
    confidence = CONFIDENCE[0] in state
    with_markov = confidence and int(state[CONFIDENCE[0]].shape[1]) == config["hidden_size"] + rank
    dflash = config["dflash_config"]
    out = {key: value for key, value in config.items() if key != "auto_map"}
    out.update({
        "architectures": [DSPARK_ARCHITECTURE],
        "markov_rank": rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": confidence,
        "confidence_head_with_markov": with_markov,
        "draft_vocab_size": config["vocab_size"],
        "sample_from_anchor": True,
        "mask_token_id": dflash["mask_token_id"],
        "target_layer_ids": list(dflash["target_layer_ids"]),
    })
    return out


def vllm_loaded_names(config: dict, names) -> set[str]:
    """The parameter names vLLM's `Qwen3DSparkForCausalLM.load_weights` loads the checkpoint's `names`
    into (its mapping replayed: see the module's docstring)."""
    mapped = []
    for name in names:
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        mapped.append(name)
    dropped = ["mask_embedding"]
    if not any("embed_tokens" in n for n in mapped):
        dropped.append("embed_tokens")
    if not any("lm_head" in n for n in mapped):
        dropped.append("lm_head")
    if not any("draft_id_to_target_id" in n for n in mapped):
        dropped.append("draft_id_to_target_id")
    if not config.get("enable_confidence_head", False) or not any("confidence_head" in n for n in mapped):
        dropped.append("confidence_head")
    return {n for n in mapped if not any(d in n for d in dropped)}


def vllm_expected_shapes(config: dict, backbone: dict[str, tuple]) -> dict[str, tuple]:
    """The parameters vLLM's model declares that a checkpoint must fill, with their shapes: the backbone's
    (`backbone`: the DFlash class's parameter shapes, which vLLM's `DFlashQwen3Model` holds under `model.`)
    and `Qwen3DSparkModel`'s heads. The embedding and lm_head are the target's (shared: never loaded)."""
    rank, vocab = config["markov_rank"], config.get("draft_vocab_size") or config["vocab_size"]
    expected = {f"model.{name}": shape for name, shape in backbone.items()}
    expected[f"model.{MARKOV_W1}"] = (config["vocab_size"], rank)
    expected[f"model.{MARKOV_W2}"] = (vocab, rank)
    if config.get("enable_confidence_head", False):
        width = config["hidden_size"] + (rank if config.get("confidence_head_with_markov", False) else 0)
        expected[f"model.{CONFIDENCE[0]}"] = (1, width)
        expected[f"model.{CONFIDENCE[1]}"] = (1,)
    return expected


def dspark_weight_name_problem(config: dict, state) -> str | None:
    """Why vLLM would not load exactly the weights of `state` (names, or names to tensors) into a DSpark
    export of `config` (a name missing, one it would not load, or a shape that differs); None when they
    match."""
    from transformers import Qwen3Config

    from dflash_ops.model import modeling_dflash

    with torch.device("meta"):
        backbone = modeling_dflash.DFlashDraftModel(Qwen3Config.from_dict(
            {k: v for k, v in config.items() if k != "architectures"}))
    expected = vllm_expected_shapes(config, {n: tuple(t.shape) for n, t in backbone.state_dict().items()})
    loaded = vllm_loaded_names(config, state)
    missing, extra = sorted(set(expected) - loaded), sorted(loaded - set(expected))
    shapes = []
    if isinstance(state, dict):  # names with their tensors: their shapes checked too
        for name, tensor in state.items():
            ours = "model." + name if "lm_head" not in name else name
            if ours in expected and ours in loaded and tuple(tensor.shape) != tuple(expected[ours]):
                shapes.append(f"{name} {tuple(tensor.shape)} (vLLM: {expected[ours]})")
    if not missing and not extra and not shapes:
        return None
    words = [f"missing {', '.join(missing)}"] if missing else []
    words += [f"not loaded by vLLM's Qwen3DSparkForCausalLM: {', '.join(extra)}"] if extra else []
    words += [f"of another shape: {', '.join(shapes)}"] if shapes else []
    return f"the weights do not match vLLM's DSpark parameters ({'; '.join(words)})"


def markov_logits(base_logits: torch.Tensor, prev_ids: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  scale: float = 1.0) -> torch.Tensor:
    """A position's corrected logits as vLLM computes them from an export's weights: the base logits
    plus `logits_processor(markov_w2, markov_w1[prev])` (`DSparkMarkovHead.bias`: the embedding times
    markov_w2's weight transposed, times the logit scale)."""
    return base_logits + scale * (w1[prev_ids] @ w2.T)
