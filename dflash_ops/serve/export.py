"""Export a trained drafter for serving: `python -m dflash_ops.export --checkpoint <dir> --out <dir>`.

The output is a Hugging Face-style directory in the layout of the public DFlash inference code
(z-lab/dflash, `DFlashDraftModel`, a Qwen3 decoder stack), which vLLM, SGLang and TensorRT-LLM
load as a DFlash drafter (docs/SERVING.md says how):

- `config.json`: a Qwen3 config with the drafter's shapes (`num_hidden_layers` = draft layers;
  hidden size, heads, head_dim, RoPE, norm epsilon, vocabulary and position limit from the target),
  `architectures: ["DFlashDraftModel"]`, `layer_types` with `use_sliding_window`, `sliding_window` and
  `max_window_layers` (`sliding_window_keys`), `num_target_layers`, `block_size`, and
  `dflash_config: {block_size, mask_token_id, target_layer_ids}`. No `is_causal`: without it every
  engine attends a full layer both ways inside the block and a sliding layer causally, as the trainer
  trained them, while an explicit value overrides every layer in current engines (docs/SERVING.md,
  "Which layers attend causally"). The RoPE base is written both as
  transformers 5 reads it (`rope_parameters`) and as transformers 4 does (top-level `rope_theta`,
  `rope_scaling`): a 4.x reader without the latter silently falls back to a base of 10000.
  `auto_map` names `modeling_dflash.DFlashDraftModel` for `AutoModel(..., trust_remote_code=True)`;
- `model.safetensors`: the trained weights (bfloat16 unless `--dtype float32`) under the names that
  code loads (`fc.weight`, `hidden_norm.weight`, `layers.<i>.self_attn.{q,k,v,o}_proj.weight`,
  `...q_norm/k_norm`, `layers.<i>.mlp.{gate,up,down}_proj.weight`, the layer norms, `norm.weight`).
  The embedding and lm_head are the target's own and are not exported: the serving side takes them
  from the target;
- `modeling_dflash.py` and `drafter.py`: this package's `dflash_ops/model/modeling_dflash.py` and
  `dflash_ops/model/drafter.py`, unchanged (the class `auto_map` names, and the layers it was trained with);
- `README.md`: how to serve this drafter with each engine, the count each engine's flag wants filled in
  (vLLM and TensorRT-LLM block_size - 1, SGLang block_size);
- `SHA256SUMS`: the sha256 of every other file (`sha256sum -c SHA256SUMS` checks a copy), written
  last: a directory without it is an export that did not finish.

`config.json` also names the target it was trained for, `dflash_target: {name_or_path, config_sha256}`
(the target config's `_name_or_path`, else its directory; the sha256 of its config.json).

`--best` exports the run's kept checkpoint with the best held-out tau (its metrics.jsonl).
The report names the step it exports (`step`); from a run's output directory, when the run trained
past that step (its status.json or metrics.jsonl: a final save that failed), a `warning` on stderr says
so and the report adds `trained_step`.
`--into DIR` writes to `DIR/<checkpoint name>` (`step-00000100`) and keeps an export already there
that its SHA256SUMS still matches (same dtype) and whose code files are this package's own (else it is
written again), refuses a DIR of another user's or reached through a link, and refuses one of another
run (config.json's `dflash_source`: the run's output directory and step, that every export records);
`--step N` picks that step of a run's output directory, `--plan` says what it would write, and writes nothing.
`load_export(dir, target)` rebuilds the drafter from such a directory (a `DSparkDrafter` for a DSpark
export, else a `DFlashDrafter`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dflash_ops.core.mask_token import mask_token_problem
from dflash_ops.core.runtime import FILE_MODE, ensure_dir, output_mode, readable, write_file
from dflash_ops.core.safe_paths import check_directory
from dflash_ops.data.target import DTYPES
from dflash_ops.model import drafter as drafter_module
from dflash_ops.model import modeling_dflash
from dflash_ops.model.drafter import SLIDING_ATTENTION, DFlashDrafter, DrafterConfig
from dflash_ops.serve.export_dspark import (
    DSPARK_ARCHITECTURE,
    dspark_hf_config,
    dspark_weight_name_problem,
    is_dspark_state,
)
from dflash_ops.training.checkpoint import (
    CHECKPOINT_DIR,
    checkpoint_name,
    find_checkpoint,
    list_checkpoints,
    new_drafter,
    step_of,
)
from dflash_ops.training.plots import read_metrics

ARCHITECTURE = "DFlashDraftModel"
DEFAULT_DTYPE = "bfloat16"
MANIFEST = "SHA256SUMS"
# The code an export carries: the transformers class that auto_map names and the layers it runs.
CODE_FILES = (Path(modeling_dflash.__file__), Path(drafter_module.__file__))
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

A DFlash speculative-decoding drafter ({layers}, block size {block_size}, {dtype}) for the target
{target_name}, a {target_type} model with {target_layers} layers (its config.json's sha256:
{target_sha}). It conditions on the target's layers
{layer_ids} (`dflash_config.target_layer_ids`; hidden_states[id + 1]) and fills each block with
the mask token {mask} (`dflash_config.mask_token_id`). It has no embedding or lm_head of its own:
the engine uses the target's. Serve it with the target it was trained for. `sha256sum -c SHA256SUMS`
in this directory checks a copy of it.

The drafter proposes block_size - 1 = {draft_tokens} tokens after each anchor. The count each engine's
flag wants (another value still gives correct output, with far fewer tokens accepted):

| engine | flag | value |
|---|---|---|
| vLLM | `num_speculative_tokens` | {draft_tokens} (block_size - 1) |
| SGLang | `--speculative-num-draft-tokens` | {block_size} (the block size, anchor included) |
| TensorRT-LLM | `max_draft_len` | {draft_tokens} (block_size - 1) |

Its layers' attention (`layer_types`): {attention}.

{thinking}

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
    --speculative-draft-model-path {out_dir} --speculative-num-draft-tokens {block_size}
```

SGLang reads the block size from `dflash_config`; another `--speculative-num-draft-tokens` only logs
"DFLASH block size mismatch". It skips weight names it does not know and never checks for missing
ones: this directory's names are exactly its class's (`fc`, `hidden_norm`, `layers.*`, `norm`), which
the export checked. SGLang serves DFlash on CUDA and NPU only, without DP attention, with pipeline
parallelism 1, and 48 running requests unless `--max-running-requests` says otherwise.

## TensorRT-LLM (PyTorch backend)

```yaml
speculative_config:
  decoding_type: DFlash
  max_draft_len: {draft_tokens}
  speculative_model_dir: {out_dir}
```

It reads `dflash_config.mask_token_id`, `target_layer_ids` and the top-level `block_size`, and sizes
its context from `max_position_embeddings`.

## The public DFlash code (z-lab/dflash, transformers 4.57.1)

```python
from transformers import AutoModel, AutoModelForCausalLM

draft = AutoModel.from_pretrained("{out_dir}", trust_remote_code=True, dtype="auto")
target = AutoModelForCausalLM.from_pretrained("<target>", dtype="auto")
output = draft.spec_generate(input_ids=input_ids, max_new_tokens=256, temperature=0.0, target=target,
                             stop_token_ids=[tokenizer.eos_token_id])
```

`AutoModel` builds this directory's own class (`modeling_dflash.py`, running `drafter.py`, the layers
the drafter was trained with) with every weight in place. Its `spec_generate` is greedy and keeps no
KV cache: it checks the drafter (the output is the target's greedy output); engines serve it fast.
`draft(target_hidden, noise_embedding, position_ids)` gives a block's hidden states, the target's
lm_head their logits. The public code's own `DFlashDraftModel.from_pretrained` loads the directory
strictly too. config.json carries the RoPE base both as `rope_parameters` (transformers 5) and as
`rope_theta` (transformers 4).
"""


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def target_identity(target_path: str, target_config_path: Path) -> dict:
    """Which target an export is for: its config's `_name_or_path` (the Hub id it was saved from), else
    the directory it was trained with; and the sha256 of its config.json, which names it whatever its path."""
    text = target_config_path.read_bytes()
    name = json.loads(text).get("_name_or_path") or target_path
    return {"name_or_path": name, "config_sha256": hashlib.sha256(text).hexdigest()}


def serving_readme(config: dict, out_dir: Path) -> str:
    """The README.md of an export whose config.json is `config`."""
    dflash = config["dflash_config"]
    return SERVING_README.format(
        layers=plural(config["num_hidden_layers"], "draft layer"), block_size=dflash["block_size"],
        dtype=config["dtype"], target_type=config.get("target_model_type") or "Qwen3-style",
        target_name=config.get("dflash_target", {}).get("name_or_path") or "(not recorded)",
        target_sha=config.get("dflash_target", {}).get("config_sha256") or "not recorded",
        target_layers=config["num_target_layers"],
        layer_ids=dflash["target_layer_ids"], mask=dflash["mask_token_id"],
        draft_tokens=dflash["block_size"] - 1, out_dir=Path(out_dir).resolve(),
        attention=attention_summary(config["layer_types"], config["sliding_window"]),
        thinking=thinking_summary(config.get("dflash_training", {})),
    )


def thinking_summary(training: dict) -> str:
    """What the exported README says of the thinking mode its data was regenerated in: `training` is the
    export's `dflash_training` (`enable_thinking_confirmed`: whether a data manifest said the mode; absent
    or null for a checkpoint from before that record)."""
    enable_thinking = training.get("enable_thinking")
    if enable_thinking is None:
        return ("Its checkpoint does not record the thinking mode of its data (Qwen3's chat-template "
                "`enable_thinking`): serve it in the mode its data was regenerated in.")
    mode = "thinking" if enable_thinking else "non-thinking"
    flag = str(enable_thinking).lower()
    if training.get("enable_thinking_confirmed") is False:
        learnt = (f"It was trained on data taken to be the target's {mode} answers (`data.enable_thinking: "
                  f"{flag}`), which no data manifest confirmed: its data was not made by `python -m "
                  "dflash_ops.data regenerate` (or by a template without the toggle), so check that it holds "
                  "that mode's answers, and")
    else:
        learnt = f"It learnt from the target's {mode} answers (`dflash_training.enable_thinking: {flag}`):"
    return (f"{learnt} serve requests in that mode (the chat template's "
            f"`enable_thinking={enable_thinking}`, e.g. vLLM's and SGLang's `chat_template_kwargs`); in the "
            "other mode it accepts far fewer tokens, with output still correct.")


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


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def export_checksums(out_dir: str | Path, dtype: str | None = None) -> dict[str, str] | None:
    """{file: sha256} of the complete export at `out_dir` (of `dtype`, when given), as its SHA256SUMS
    lists them, when every file still has its checksum; None otherwise (no export, one that did not
    finish, one changed since, another dtype)."""
    out_dir = Path(out_dir)
    try:
        lines = (out_dir / MANIFEST).read_text().splitlines()
        sums = {name: digest for digest, name in (line.split("  ", 1) for line in lines)}
        if dtype is not None and json.loads((out_dir / "config.json").read_text()).get("dtype") != dtype:
            return None
        if not sums or any(sha256_of(out_dir / name) != digest for name, digest in sums.items()):
            return None
    except (OSError, ValueError):
        return None
    # Its code is what a loader runs (trust_remote_code): kept only while it is this release's own.
    if any(sums.get(source.name) != sha256_of(source) for source in CODE_FILES):
        return None
    return sums


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: str = DEFAULT_DTYPE) -> Path:
    """Write the export of `checkpoint` (a step directory) to `out_dir`; returns `out_dir`."""
    checkpoint = Path(checkpoint)
    # The weights and the meta only: the optimizer state (trainer.pt) is no part of an export.
    model_state = load_file(readable(checkpoint / "model.safetensors"))
    meta = json.loads((checkpoint / "meta.json").read_text())
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
    if is_dspark_state(model_state):  # DSpark's heads, in vLLM's Qwen3DSparkModel layout (export_dspark)
        config = dspark_hf_config(config, model_state)
    # How it was trained to weigh the block positions (optim.loss_weighting), for whoever compares drafters,
    # and the thinking mode of its data (data.enable_thinking; null: a checkpoint that did not record it),
    # the mode to serve it in, with whether a data manifest confirmed it (null: a checkpoint from before).
    config["dflash_target"] = target_identity(meta["target_path"], target_config_path)
    # Where it comes from (the run's output directory and the step), so that `--into` never takes another
    # run's export of the same step for this one's.
    config["dflash_source"] = {"run": str(run_of(checkpoint)), "step": meta.get("step")}
    config["dflash_training"] = {**(meta.get("loss_weighting") or {"loss_weighting": "decay"}),
                                 "enable_thinking": meta.get("enable_thinking"),
                                 "enable_thinking_confirmed": meta.get("enable_thinking_confirmed")}
    problem = weight_name_problem(config, model_state)
    if problem is not None:
        raise ValueError(f"{checkpoint}: {problem}; nothing was exported")
    out_dir = ensure_dir(out_dir)
    (out_dir / MANIFEST).unlink(missing_ok=True)  # until it is written again, the export is unfinished
    weights = {name: tensor.to(DTYPES[dtype]).contiguous() for name, tensor in model_state.items()}
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out_dir / "model.safetensors", output_mode(FILE_MODE))  # readable by the serving side
    write_file(out_dir / "config.json", json.dumps(config, indent=2) + "\n")
    for source in CODE_FILES:
        write_file(out_dir / source.name, source.read_text())
    write_file(out_dir / "README.md", serving_readme(config, out_dir))
    names = ["config.json", "model.safetensors", *(source.name for source in CODE_FILES), "README.md"]
    write_file(out_dir / MANIFEST, "".join(f"{sha256_of(out_dir / name)}  {name}\n" for name in names))
    return out_dir


def weight_name_problem(config: dict, names) -> str | None:
    """Why a loader would not get exactly the weights `names` (SGLang skips a name it does not know and
    never checks for a missing one, so a misnamed export would serve with random weights): the names
    checked against the parameters of the class the export ships (`modeling_dflash.DFlashDraftModel`,
    built from `config` on the meta device). None when they match."""
    from transformers import Qwen3Config

    if config.get("architectures") == [DSPARK_ARCHITECTURE]:  # checked against vLLM's DSpark loader
        return dspark_weight_name_problem(config, names)
    with torch.device("meta"):
        model = modeling_dflash.DFlashDraftModel(Qwen3Config.from_dict(config))
    expected, got = set(model.state_dict()), set(names)
    missing, extra = sorted(expected - got), sorted(got - expected)
    if not missing and not extra:
        return None
    words = [f"missing {', '.join(missing)}"] if missing else []
    words += [f"not loaded by the exported class: {', '.join(extra)}"] if extra else []
    return f"the weights do not match the exported class's parameters ({'; '.join(words)})"


def export_dspark_args(config: dict) -> dict | None:
    """The DSpark heads an export's config (its config.json) declares, as vLLM's `Qwen3DSparkModel` reads
    them (`markov_rank`, `enable_confidence_head`, `confidence_head_with_markov`); None for a DFlash
    export."""
    if list(config.get("architectures") or []) != [DSPARK_ARCHITECTURE]:
        return None
    return {"markov_rank": config["markov_rank"],
            "confidence_head": bool(config.get("enable_confidence_head")),
            "confidence_with_markov": bool(config.get("confidence_head_with_markov"))}


def load_export(path: str | Path, target: nn.Module) -> tuple[DFlashDrafter, list[int]]:
    """The drafter of an export at `path` (a DSparkDrafter, its heads loaded, when the config's architecture
    is DSpark's) around `target`'s embedding and lm_head, in eval mode and the target's device and dtype;
    with its target layer ids."""
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    drafter_cfg = modeling_dflash.drafter_config_from_hf(config)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    drafter = new_drafter(drafter_cfg, embed, head, export_dspark_args(config.to_dict()))
    state = load_file(readable(path / "model.safetensors"))
    drafter.load_trainable_state_dict({name: t.to(torch.float32) for name, t in state.items()})
    drafter.to(device=embed.weight.device, dtype=embed.weight.dtype).eval()
    return drafter, list(config.dflash_config["target_layer_ids"])


def best_step(run_dir: str | Path) -> int:
    """The step of the run's kept checkpoint with the best held-out tau (its metrics.jsonl's `heldout`
    records); FileNotFoundError saying why when no kept checkpoint has one."""
    kept = {step_of(p) for p in list_checkpoints(run_dir)}
    try:
        heldout = read_metrics(run_dir).get("heldout", {})
    except (FileNotFoundError, ValueError) as exc:
        raise FileNotFoundError(f"--best: {exc}") from exc
    taus = {step: record["heldout_tau"] for step, record in heldout.items()
            if step in kept and record.get("heldout_tau") is not None}
    if not taus:
        raise FileNotFoundError(f"--best: no kept checkpoint of {run_dir} has a held-out tau (checkpoints: "
                                f"{sorted(kept) or 'none'}; a run measures one every run.eval_every steps "
                                "with data.eval_path set): name one with --step, or export the latest")
    return max(taus, key=lambda step: (taus[step], step))


def trained_step(run_dir: str | Path) -> int | None:
    """The last step the run in `run_dir` trained, as its status.json and metrics.jsonl know it (None when
    neither says: a checkpoint's own directory, or a run without them)."""
    steps = []
    try:
        steps.append(json.loads((Path(run_dir) / "status.json").read_text()).get("step"))
    except (OSError, ValueError, AttributeError):
        pass
    try:
        steps += list(read_metrics(run_dir).get("train", {}))
    except (FileNotFoundError, ValueError):
        pass
    steps = [step for step in steps if isinstance(step, int)]
    return max(steps) if steps else None


def unsaved_steps_warning(run_dir: str | Path, step: int) -> tuple[int, str] | None:
    """(the run's last trained step, a warning) when the run in `run_dir` trained past `step`, the step
    exported: the steps after it are in no checkpoint that this export holds."""
    trained = trained_step(run_dir)
    if trained is None or trained <= step:
        return None
    return trained, (f"exporting step {step}, but the run in {run_dir} trained to step {trained}: steps "
                     f"{step + 1}-{trained} are not in this checkpoint (a save that failed, or one still to "
                     "come; its status.json's checkpoint_error says why a save failed)")


def run_of(checkpoint: str | Path) -> Path:
    """The output directory of the run a checkpoint (<run>/checkpoints/step-N) belongs to."""
    return Path(checkpoint).resolve().parent.parent


def check_not_foreign(out_dir: Path, source: Path, into: str | Path) -> None:
    """Refuse `--into` where `out_dir` holds the export of another run than `source`'s (its config.json's
    `dflash_source`; an export that does not say is not refused), before it is kept or written over."""
    try:
        origin = json.loads((out_dir / "config.json").read_text()).get("dflash_source") or {}
    except (OSError, ValueError, AttributeError):
        return
    run = origin.get("run")
    if run and Path(run) != run_of(source):
        raise ValueError(f"--into {into}: {out_dir} holds the export of another run ({run}, step "
                         f"{origin.get('step')}), not of {run_of(source)}; nothing was written: export into "
                         "another directory (one per run), or remove that one")


def run_export(checkpoint: str | Path, step: int | None, out: str | Path | None, into: str | Path | None,
               dtype: str, plan: bool) -> dict:
    """What main prints: the checkpoint picked, where its export goes, and its files' checksums. With
    `into` and `step`, an export of that step already there is kept even when the run has removed
    the checkpoint since (its `checkpoint` is then null)."""
    latest = step is None  # the run's latest checkpoint: warned of when the run trained past it
    if into is not None and os.path.lexists(into):
        check_directory(into)  # only this user's exports are kept or written over: never another user's
    kept = Path(into) / checkpoint_name(step) if into is not None and step is not None else None
    sums = export_checksums(kept, dtype) if kept is not None else None
    if sums is not None:
        source, out_dir = Path(checkpoint) / CHECKPOINT_DIR / checkpoint_name(step), kept
        check_not_foreign(out_dir, source, into)
    else:
        source = find_checkpoint(checkpoint, step)
        out_dir = Path(out) if out is not None else Path(into) / source.name
        if into is not None:
            check_not_foreign(out_dir, source, into)
        try:
            step = json.loads((source / "meta.json").read_text())["step"]
            sums = export_checksums(out_dir, dtype) if into is not None else None
            if sums is None and not plan:
                export_checkpoint(source, out_dir, dtype)
        except FileNotFoundError as err:
            if not source.is_dir():  # the run removed it meanwhile (it keeps the latest K)
                raise FileNotFoundError(f"the run removed checkpoint {source} while it was read (a run "
                                        "keeps the latest run.keep_checkpoints): ask again") from err
            raise
    report = {"checkpoint": str(source) if source.is_dir() else None, "step": step, "out": str(out_dir),
              "dtype": dtype}
    from_run = latest and Path(checkpoint).resolve() != source.resolve()
    newer = unsaved_steps_warning(checkpoint, step) if from_run else None
    if newer is not None:  # the run trained steps that no exported checkpoint holds
        report["trained_step"] = newer[0]
        print(json.dumps({"event": "warning", "message": newer[1]}), file=sys.stderr)
    if plan:
        return {"event": "plan", **report, "exists": sums is not None, "files": sums or {}}
    return {"event": "exported", **report, "reused": sums is not None,
            "files": sums or export_checksums(out_dir)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_ops.export",
        description="Write a trained drafter as a Hugging Face-style directory (config.json, "
                    "model.safetensors, its modeling code, a README and SHA256SUMS) that vLLM, SGLang and "
                    "the DFlash inference code (DFlashDraftModel) load.",
    )
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint directory, or a run's output directory (its latest checkpoint)")
    pick = parser.add_mutually_exclusive_group()
    pick.add_argument("--step", type=int,
                      help="with a run's output directory: the checkpoint of this step (default: latest)")
    pick.add_argument("--best", action="store_true",
                      help="with a run's output directory: its kept checkpoint of the best held-out tau")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="the directory to write (created if missing)")
    where.add_argument("--into", help="write DIR/<checkpoint name> (step-00000100); an export already there "
                                      "that its SHA256SUMS matches, of the same dtype, is kept")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=DEFAULT_DTYPE,
                        help=f"weight dtype of the export (default: {DEFAULT_DTYPE}, what engines serve)")
    parser.add_argument("--plan", action="store_true", help="print what would be written; write nothing")
    args = parser.parse_args(argv)
    try:
        step = best_step(args.checkpoint) if args.best else args.step
        report = run_export(args.checkpoint, step, args.out, args.into, args.dtype, args.plan)
    except (FileNotFoundError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
