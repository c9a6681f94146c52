"""Export a trained drafter for serving: `python -m dflash.export --checkpoint <dir> --out <dir>`.

The output is a Hugging Face-style directory in the layout of the public DFlash inference code
(z-lab/dflash, `DFlashDraftModel`, a Qwen3 decoder stack; SGLang's DFlash drafter reads the same):

- `config.json`: a Qwen3 config with the drafter's shapes (`num_hidden_layers` = draft layers;
  hidden size, heads, head_dim, RoPE, norm epsilon, vocabulary and position limit from the target),
  `architectures: ["DFlashDraftModel"]`, `is_causal: false` (attention inside a block is
  bidirectional), `num_target_layers`, `block_size`, and
  `dflash_config: {block_size, mask_token_id, target_layer_ids}`;
- `model.safetensors`: the trained weights under the names that code loads (`fc.weight`,
  `hidden_norm.weight`, `layers.<i>.self_attn.{q,k,v,o}_proj.weight`, `...q_norm/k_norm`,
  `layers.<i>.mlp.{gate,up,down}_proj.weight`, the layer norms, `norm.weight`). The embedding and
  lm_head are the target's own and are not exported: the serving side takes them from the target.

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

from dflash.checkpoint import load_checkpoint
from dflash.model import DFlashDrafter, DrafterConfig
from dflash.runtime import FILE_MODE, ensure_dir, output_mode, write_file
from dflash.target import DTYPES

ARCHITECTURE = "DFlashDraftModel"


def drafter_hf_config(drafter_cfg: DrafterConfig, layer_ids: list[int], target_config: dict,
                      dtype: str) -> dict:
    """The config.json of an exported drafter; `target_config` is the target's config.json."""
    target = target_config.get("text_config") or target_config
    dflash = {"block_size": drafter_cfg.block_size, "mask_token_id": drafter_cfg.mask_token_id,
              "target_layer_ids": list(layer_ids)}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": drafter_cfg.hidden_size,
        "intermediate_size": drafter_cfg.intermediate_size,
        "num_attention_heads": drafter_cfg.num_attention_heads,
        "num_key_value_heads": drafter_cfg.num_key_value_heads,
        "head_dim": drafter_cfg.head_dim,
        "num_hidden_layers": drafter_cfg.num_layers,
        "layer_types": ["full_attention"] * drafter_cfg.num_layers,
        "vocab_size": drafter_cfg.vocab_size,
        "rms_norm_eps": drafter_cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": drafter_cfg.rope_theta},
        "max_position_embeddings": target.get("max_position_embeddings"),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "is_causal": False,
        "use_sliding_window": False,
        "sliding_window": None,
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


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """Write the export of `checkpoint` (a step directory) to `out_dir`; returns `out_dir`."""
    model_state, _, meta = load_checkpoint(checkpoint)
    drafter_cfg = DrafterConfig(**meta["drafter_config"])
    dtype = dtype or meta.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    target_config_path = Path(meta["target_path"]) / "config.json"
    if not target_config_path.is_file():
        raise FileNotFoundError(f"the checkpoint's target has no config at {target_config_path}")
    config = drafter_hf_config(drafter_cfg, meta["layer_ids"], json.loads(target_config_path.read_text()),
                               dtype)
    out_dir = ensure_dir(out_dir)
    weights = {name: tensor.to(DTYPES[dtype]).contiguous() for name, tensor in model_state.items()}
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out_dir / "model.safetensors", output_mode(FILE_MODE))  # readable by the serving side
    write_file(out_dir / "config.json", json.dumps(config, indent=2) + "\n")
    return out_dir


def load_export(path: str | Path, target: nn.Module) -> tuple[DFlashDrafter, list[int]]:
    """The drafter of an export at `path` around `target`'s embedding and lm_head, in eval mode and
    the target's device and dtype; with its target layer ids."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    dflash = config["dflash_config"]
    drafter_cfg = DrafterConfig(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"], num_layers=config["num_hidden_layers"],
        num_target_features=len(dflash["target_layer_ids"]), block_size=dflash["block_size"],
        mask_token_id=dflash["mask_token_id"], vocab_size=config["vocab_size"],
        rms_norm_eps=config["rms_norm_eps"], rope_theta=config["rope_parameters"]["rope_theta"],
    )
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    drafter = DFlashDrafter(drafter_cfg, embed, head)
    state = load_file(str(path / "model.safetensors"))
    drafter.load_trainable_state_dict({name: t.to(torch.float32) for name, t in state.items()})
    drafter.to(device=embed.weight.device, dtype=embed.weight.dtype).eval()
    return drafter, list(dflash["target_layer_ids"])


def main(argv: list[str] | None = None) -> int:
    from dflash.evaluate import resolve_checkpoint

    parser = argparse.ArgumentParser(
        prog="python -m dflash.export",
        description="Write a trained drafter as a Hugging Face-style directory (config.json and "
                    "model.safetensors) that DFlash inference code (DFlashDraftModel) loads.",
    )
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint directory, or a run's output directory (its latest checkpoint)")
    parser.add_argument("--out", required=True, help="the directory to write (created if missing)")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="weight dtype of the export (default: the run's model.dtype)")
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
