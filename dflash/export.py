"""Export a trained drafter for serving: `python -m dflash.export --checkpoint <dir> --out <dir>`.

The output is a Hugging Face-style directory in the layout of the public DFlash inference code
(z-lab/dflash, `DFlashDraftModel`, a Qwen3 decoder stack), which vLLM, SGLang and TensorRT-LLM
load as a DFlash drafter (docs/SERVING.md says how):

- `config.json`: a Qwen3 config with the drafter's shapes (`num_hidden_layers` = draft layers;
  hidden size, heads, head_dim, RoPE, norm epsilon, vocabulary and position limit from the target),
  `architectures: ["DFlashDraftModel"]`, `is_causal: false` (attention inside a block is
  bidirectional), `layer_types` with `use_sliding_window`, `sliding_window` and
  `max_window_layers` (`sliding_window_keys`), `num_target_layers`, `block_size`, and
  `dflash_config: {block_size, mask_token_id, target_layer_ids}`. The RoPE base is written both as
  transformers 5 reads it (`rope_parameters`) and as transformers 4 does (top-level `rope_theta`,
  `rope_scaling`): a 4.x reader without the latter silently falls back to a base of 10000.
  `auto_map` names `modeling_dflash.DFlashDraftModel` for `AutoModel(..., trust_remote_code=True)`;
- `model.safetensors`: the trained weights (bfloat16 unless `--dtype float32`) under the names that
  code loads (`fc.weight`, `hidden_norm.weight`, `layers.<i>.self_attn.{q,k,v,o}_proj.weight`,
  `...q_norm/k_norm`, `layers.<i>.mlp.{gate,up,down}_proj.weight`, the layer norms, `norm.weight`).
  The embedding and lm_head are the target's own and are not exported: the serving side takes them
  from the target;
- `modeling_dflash.py` and `model.py`: this package's `dflash/modeling_dflash.py` and
  `dflash/model.py`, unchanged (the class `auto_map` names, and the layers it was trained with);
- `README.md`: how to serve this drafter, its speculative token count (block_size - 1) filled in.

`load_export(dir, target)` rebuilds a `DFlashDrafter` from such a directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dflash import model as model_module
from dflash import modeling_dflash
from dflash.checkpoint import load_checkpoint
from dflash.mask_token import mask_token_problem
from dflash.model import SLIDING_ATTENTION, DFlashDrafter, DrafterConfig
from dflash.runtime import FILE_MODE, ensure_dir, output_mode, write_file
from dflash.target import DTYPES

ARCHITECTURE = "DFlashDraftModel"
DEFAULT_DTYPE = "bfloat16"
# The code an export carries: the transformers class that auto_map names and the layers it runs.
CODE_FILES = (Path(modeling_dflash.__file__), Path(model_module.__file__))
AUTO_MAP = {"AutoModel": f"{Path(modeling_dflash.__file__).stem}.{ARCHITECTURE}"}


def sliding_window_keys(drafter_cfg: DrafterConfig) -> dict:
    """The keys of a Qwen3 config that say which layers slide and by how much. `layer_types` is what
    vLLM, SGLang and transformers read; transformers' Qwen3Config (4.57 and 5) drops
    `sliding_window` unless `use_sliding_window` is true, and derives the layer types from
    `max_window_layers` (layers from that index on slide) only when `layer_types` is missing, so
    `max_window_layers` is the first sliding layer (exact when the sliding layers are the last ones;
    the layer count when none slides)."""
    types = drafter_cfg.layer_types
    sliding = SLIDING_ATTENTION in types
    return {"layer_types": list(types), "use_sliding_window": sliding,
            "sliding_window": drafter_cfg.sliding_window if sliding else None,
            "max_window_layers": types.index(SLIDING_ATTENTION) if sliding else len(types)}


def drafter_hf_config(drafter_cfg: DrafterConfig, layer_ids: list[int], target_config: dict,
                      dtype: str) -> dict:
    """The config.json of an exported drafter; `target_config` is the target's config.json."""
    target = target_config.get("text_config") or target_config
    dflash = {"block_size": drafter_cfg.block_size, "mask_token_id": drafter_cfg.mask_token_id,
              "target_layer_ids": list(layer_ids)}
    return {
        "architectures": [ARCHITECTURE],
        "auto_map": AUTO_MAP,
        "model_type": "qwen3",
        "hidden_size": drafter_cfg.hidden_size,
        "intermediate_size": drafter_cfg.intermediate_size,
        "num_attention_heads": drafter_cfg.num_attention_heads,
        "num_key_value_heads": drafter_cfg.num_key_value_heads,
        "head_dim": drafter_cfg.head_dim,
        "num_hidden_layers": drafter_cfg.num_layers,
        **sliding_window_keys(drafter_cfg),
        "vocab_size": drafter_cfg.vocab_size,
        "rms_norm_eps": drafter_cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": drafter_cfg.rope_theta},
        "rope_theta": drafter_cfg.rope_theta,  # transformers 4.x reads only these two
        "rope_scaling": None,
        "max_position_embeddings": target.get("max_position_embeddings"),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "is_causal": False,
        "tie_word_embeddings": False,
        "use_cache": False,
        "bos_token_id": target.get("bos_token_id"),
        "eos_token_id": target.get("eos_token_id"),
        "pad_token_id": target.get("pad_token_id"),
        "dtype": dtype,
        "num_target_layers": target["num_hidden_layers"],
        "target_model_type": target.get("model_type"),
        "block_size": drafter_cfg.block_size,
        "dflash_config": dflash,
    }


SERVING_README = """# DFlash drafter

A DFlash speculative-decoding drafter ({layers} draft layers, block size {block_size}, {dtype}) for a
{target_type} target with {target_layers} layers. It conditions on the target's layers
{layer_ids} (`dflash_config.target_layer_ids`; hidden_states[id + 1]) and fills each block with
the mask token {mask} (`dflash_config.mask_token_id`). It has no embedding or lm_head of its own:
the engine uses the target's. Serve it with the target it was trained for.

Every engine proposes block_size - 1 = {draft_tokens} tokens per step.

Its layers' attention (`layer_types`): {attention}.

## vLLM

```python
from vllm import LLM

llm = LLM(model="<target>", speculative_config={{
    "method": "dflash", "model": "{out_dir}", "num_speculative_tokens": {draft_tokens}}})
```

or on the command line:

```
--speculative-config '{{"method": "dflash", "model": "{out_dir}", "num_speculative_tokens": {draft_tokens}}}'
```

Always pass `"method": "dflash"` (vLLM guesses it only from a path containing "dflash") and
`num_speculative_tokens` = {draft_tokens}: vLLM ignores `block_size`, and another count still gives
correct output, with far fewer tokens accepted.

## SGLang

```
python -m sglang.launch_server --model-path <target> --speculative-algorithm DFLASH \\
    --speculative-draft-model-path {out_dir}
```

SGLang reads the block size from `dflash_config`. It skips weight names it does not know without
a word: this directory's names are `fc`, `hidden_norm`, `layers.*`, `norm`.

## The public DFlash code (z-lab/dflash, transformers 4.57.1)

```python
from transformers import AutoModel, AutoModelForCausalLM

draft = AutoModel.from_pretrained("{out_dir}", trust_remote_code=True, dtype="auto")
target = AutoModelForCausalLM.from_pretrained("<target>", dtype="auto")
output = draft.spec_generate(input_ids=input_ids, max_new_tokens=256, temperature=0.0, target=target,
                             stop_token_ids=[tokenizer.eos_token_id])
```

`AutoModel` builds this directory's own class (`modeling_dflash.py`, running `model.py`, the layers
the drafter was trained with) with every weight in place. Its `spec_generate` is greedy and keeps no
KV cache: it checks the drafter (the output is the target's greedy output); engines serve it fast.
`draft(target_hidden, noise_embedding, position_ids)` gives a block's hidden states, the target's
lm_head their logits. The public code's own `DFlashDraftModel.from_pretrained` loads the directory
strictly too. config.json carries the RoPE base both as `rope_parameters` (transformers 5) and as
`rope_theta` (transformers 4).
"""


def serving_readme(config: dict, out_dir: Path) -> str:
    """The README.md of an export whose config.json is `config`."""
    dflash = config["dflash_config"]
    return SERVING_README.format(
        layers=config["num_hidden_layers"], block_size=dflash["block_size"], dtype=config["dtype"],
        target_type=config.get("target_model_type") or "Qwen3-style",
        target_layers=config["num_target_layers"],
        layer_ids=dflash["target_layer_ids"], mask=dflash["mask_token_id"],
        draft_tokens=dflash["block_size"] - 1, out_dir=Path(out_dir).resolve(),
        attention=attention_summary(config["layer_types"], config["sliding_window"]),
    )


def attention_summary(layer_types: list[str], window: int | None) -> str:
    """What the exported README says of the layers' attention."""
    if SLIDING_ATTENTION not in layer_types:
        return "all full_attention"
    text = (f"{', '.join(layer_types)}; the sliding_attention layers have a window of {window} tokens "
            f"(a query at position p sees positions p-{window - 1}..p, as Hugging Face and the engines "
            "count it)")
    if len(set(layer_types)) > 1:
        text += ". vLLM serves mixed layer types with its V2 model runner only (VLLM_USE_V2_MODEL_RUNNER=1)"
    return text


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: str = DEFAULT_DTYPE) -> Path:
    """Write the export of `checkpoint` (a step directory) to `out_dir`; returns `out_dir`."""
    model_state, _, meta = load_checkpoint(checkpoint)
    drafter_cfg = DrafterConfig(**meta["drafter_config"])
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    target_config_path = Path(meta["target_path"]) / "config.json"
    if not target_config_path.is_file():
        raise FileNotFoundError(f"the checkpoint's target has no config at {target_config_path}")
    problem = mask_token_problem(drafter_cfg.mask_token_id, meta["target_path"], drafter_cfg.vocab_size)
    if problem is not None:
        # The weights learnt this mask, so the export keeps it; only training again changes it.
        message = f"the checkpoint's mask token: {problem} (for this checkpoint: by training again)"
        print(json.dumps({"event": "warning", "message": message}), file=sys.stderr)
    config = drafter_hf_config(drafter_cfg, meta["layer_ids"], json.loads(target_config_path.read_text()),
                               dtype)
    out_dir = ensure_dir(out_dir)
    weights = {name: tensor.to(DTYPES[dtype]).contiguous() for name, tensor in model_state.items()}
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out_dir / "model.safetensors", output_mode(FILE_MODE))  # readable by the serving side
    write_file(out_dir / "config.json", json.dumps(config, indent=2) + "\n")
    for source in CODE_FILES:
        write_file(out_dir / source.name, source.read_text())
    write_file(out_dir / "README.md", serving_readme(config, out_dir))
    return out_dir


def load_export(path: str | Path, target: nn.Module) -> tuple[DFlashDrafter, list[int]]:
    """The drafter of an export at `path` around `target`'s embedding and lm_head, in eval mode and
    the target's device and dtype; with its target layer ids."""
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    drafter_cfg = modeling_dflash.drafter_config_from_hf(config)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    drafter = DFlashDrafter(drafter_cfg, embed, head)
    state = load_file(str(path / "model.safetensors"))
    drafter.load_trainable_state_dict({name: t.to(torch.float32) for name, t in state.items()})
    drafter.to(device=embed.weight.device, dtype=embed.weight.dtype).eval()
    return drafter, list(config.dflash_config["target_layer_ids"])


def main(argv: list[str] | None = None) -> int:
    from dflash.evaluate import resolve_checkpoint

    parser = argparse.ArgumentParser(
        prog="python -m dflash.export",
        description="Write a trained drafter as a Hugging Face-style directory (config.json, "
                    "model.safetensors, its modeling code and a README) that vLLM, SGLang and the "
                    "DFlash inference code (DFlashDraftModel) load.",
    )
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint directory, or a run's output directory (its latest checkpoint)")
    parser.add_argument("--out", required=True, help="the directory to write (created if missing)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=DEFAULT_DTYPE,
                        help=f"weight dtype of the export (default: {DEFAULT_DTYPE}, what engines serve)")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(resolve_checkpoint(args.checkpoint), args.out, args.dtype)
    except (FileNotFoundError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"event": "exported", "out": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
