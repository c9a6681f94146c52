"""Acceptance length of a drafter: greedy speculative decoding where the target verifies each block.

`python -m dflash_ops.evaluate --checkpoint <dir> [--config <yaml>]` decodes held-out prompts (the tokens
where loss_mask is 0 in `--data`, else the config's `data.eval_path`, else `eval.jsonl` next to the
training data) and reports, per proposer (`<dir>`: a checkpoint, a run's output directory or an export;
the config defaults to the checkpoint's own; a drafter of another target is refused before any model
loads):

- tau, the mean acceptance length: tokens gained per verify step (accepted drafts + the target's
  own next token), between 1 and the block size b; only tokens the output keeps count (none past
  `--max-new-tokens` or the end of text), so tau times the verify steps is the tokens generated
  after the first (which the prompt's own forward pass gives);
- the per-position acceptance rate: for draft position k, the fraction of verify steps whose first
  k drafted tokens were all accepted;
- the verify-step count (target forward passes after the prompt's);
- the accepted drafts per position as counts, before the budget's or the end of text's cut: what
  an engine's counters give (vLLM's accepted tokens per position), for a side-by-side check.

Reference rows, on the same prompts: the untrained drafter (same seed, no training), prompt lookup
(`dflash_ops.serve.baselines`: copy what followed the last earlier match of the latest n-gram; no training,
no model) and the target itself as drafter (its own greedy continuation: every draft is accepted,
tau = b but for the budget's last step, the upper bound).

A DSpark drafter (`model.kind: dspark`, from a checkpoint, a run or a DSpark export) is evaluated as vLLM's
DSparkProposer drafts (`dflash_ops.serve.dspark_decode`): b drafts a step where DFlash makes b-1, so every
row, prompt lookup and the target's included, drafts b a step and is verified with a block of b+1; the
untrained row is a DSpark drafter of the same seed, and the output says the kind (`drafter_kind`,
`drafts_per_step` in `--json`). A drafter of another kind than the config's model.kind is refused.

One step: the anchor is the last token so far; the drafter sees the target's hidden states of every
earlier position (as in training: context strictly before the anchor) and proposes b-1 tokens;
the target runs once on the sequence plus the block, keeps the longest prefix of drafts that
equals its own greedy choices, and adds its own next token. The output is therefore exactly the
target's greedy decoding whatever the drafter proposes; only the number of steps changes.
For clarity the target recomputes the whole sequence at each step (no KV cache): the acceptance
figures do not depend on it.

What it measured is said with the figures: the checkpoint (a run's output directory: its latest at the
start) and its step, the data file and the number of prompts, on a line above the table, or as
`checkpoint`, `step`, `data`, `prompts` in the `--json` object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

from dflash_ops.core.config import ConfigError, TrainConfig, load_config, target_text_config
from dflash_ops.data.examples import DataError, load_examples
from dflash_ops.data.target import TargetHead, load_target
from dflash_ops.model.acceptance import AcceptanceStats
from dflash_ops.model.drafter import DFlashDrafter
from dflash_ops.model.dspark import DSparkDrafter
from dflash_ops.model.hidden_states import get_hidden_states_packed
from dflash_ops.model.loss import build_block_attention_mask
from dflash_ops.serve.baselines import Proposer, prompt_lookup_proposer
from dflash_ops.serve.dspark_decode import dspark_proposer
from dflash_ops.serve.export import export_dspark_args, load_export
from dflash_ops.training.checkpoint import (
    checkpoint_dspark_args,
    find_checkpoint,
    fit_to_checkpoint,
    load_checkpoint,
)
from dflash_ops.training.resume_check import TARGET_SHAPE, describe
from dflash_ops.training.trainer import build_drafter, resolve_layer_ids


def _target_forward(target: nn.Module, tokens: list[int], layer_ids: list[int]):
    """Greedy next tokens `[L]` of every position and the packed features `[L, k*H]` of `tokens`."""
    ids = torch.tensor([tokens], dtype=torch.long, device=target.device)
    out = target(input_ids=ids, output_hidden_states=True, use_cache=False)
    features = get_hidden_states_packed(out.hidden_states, layer_ids, torch.ones_like(ids)).features
    return out.logits[0].argmax(-1).tolist(), features


@torch.no_grad()
def speculative_decode(target: nn.Module, propose: Proposer, prompt: list[int], layer_ids: list[int],
                       block_size: int, max_new_tokens: int, eos_token_id: int | None,
                       stats: AcceptanceStats) -> list[int]:
    """Greedy speculative decoding of `prompt`; appends each verify step's gain to `stats`."""
    greedy, features = _target_forward(target, prompt, layer_ids)
    generated = [greedy[-1]]
    while len(generated) < max_new_tokens and generated[-1] != eos_token_id:
        sequence = prompt + generated
        # Context: every position before the anchor (the last token), whose features are known.
        drafts = propose(sequence, features[: len(sequence) - 1])
        if len(drafts) != block_size - 1:
            raise ValueError(f"a proposer returned {len(drafts)} drafts, expected {block_size - 1}")
        greedy, features = _target_forward(target, sequence + drafts, layer_ids)
        verified = greedy[len(sequence) - 1:]  # the target's token after the anchor and each draft
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == verified[accepted]:
            accepted += 1
        stats.accepted.append(accepted)
        gained = drafts[:accepted] + [verified[accepted]]
        # Only what the output keeps counts: nothing past the token budget or an end of text.
        gained = gained[: max_new_tokens - len(generated)]
        if eos_token_id in gained:
            gained = gained[: gained.index(eos_token_id) + 1]
        stats.lengths.append(len(gained))
        generated += gained
    stats.generated_tokens += len(generated)
    return generated


def end_of_text_id(target: nn.Module) -> int | None:
    """The token that ends the target's generation (the first of its generation config's), if any."""
    eos = target.generation_config.eos_token_id if target.generation_config is not None else None
    return eos[0] if isinstance(eos, list) else eos


def drafter_proposer(drafter: DFlashDrafter) -> Proposer:
    """Draft b-1 tokens in one drafter pass: block `[anchor, MASK x (b-1)]` after the context."""
    cfg = drafter.cfg
    drafter.eval()

    def propose(sequence: list[int], context: torch.Tensor) -> list[int]:
        device = context.device
        n_context = context.shape[0]
        context_positions = torch.arange(n_context, device=device)
        anchor = torch.tensor([n_context], device=device)
        block_ids = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long, device=device)
        block_ids[0] = sequence[-1]
        mask = build_block_attention_mask(torch.zeros(n_context, dtype=torch.long, device=device),
                                          context_positions, torch.zeros(1, dtype=torch.long, device=device),
                                          anchor, cfg.block_size)
        hidden = drafter(context, context_positions, block_ids, n_context + torch.arange(cfg.block_size,
                         device=device), mask)
        return drafter.logits(hidden[1:]).argmax(-1).tolist()

    return propose


def drafter_kind(drafter: DFlashDrafter) -> str:
    return "dspark" if isinstance(drafter, DSparkDrafter) else "dflash"


def kind_proposer(drafter: DFlashDrafter) -> tuple[Proposer, int]:
    """The proposer of a drafter of either kind and the `speculative_decode` block size that verifies it
    (its drafts a step plus one): a DSpark drafter of block b drafts b tokens a step (vLLM's DSparkProposer),
    verified with b + 1; a DFlash one b - 1, verified with b."""
    if isinstance(drafter, DSparkDrafter):
        return dspark_proposer(drafter), drafter.cfg.block_size + 1
    return drafter_proposer(drafter), drafter.cfg.block_size


def target_proposer(target: nn.Module, block_size: int) -> Proposer:
    """The target's own greedy continuation as drafts: the upper bound (every draft accepted)."""

    def propose(sequence: list[int], context: torch.Tensor) -> list[int]:
        tokens = list(sequence)
        for _ in range(block_size - 1):
            ids = torch.tensor([tokens], dtype=torch.long, device=target.device)
            logits = target(input_ids=ids, use_cache=False, logits_to_keep=1).logits
            tokens.append(int(logits[0, -1].argmax()))
        return tokens[len(sequence):]

    return propose


def eval_prompts(data_path: str | Path, max_length: int, limit: int | None) -> list[list[int]]:
    """The prompt of each held-out example: its tokens before the first response (loss_mask 1) token."""
    prompts = []
    for example in load_examples(data_path, max_length):
        mask = example.loss_mask.tolist()
        prompt_len = mask.index(1) if 1 in mask else len(mask)
        if prompt_len > 0:
            prompts.append(example.input_ids[:prompt_len].tolist())
    if not prompts:
        raise DataError(f"{data_path}: no example has a prompt (tokens with loss_mask 0 before the response)")
    return prompts[:limit] if limit else prompts


def is_export(path: str | Path) -> bool:
    """Whether `path` is a `dflash_ops.export` directory (a config.json, weights, no checkpoint meta)."""
    path = Path(path)
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file() \
        and not (path / "meta.json").is_file()


def heldout_path(cfg: TrainConfig, given: str | None) -> str:
    """The held-out rows to decode: `--data`, else data.eval_path, else eval.jsonl beside data.path."""
    if given:
        return given
    if cfg.data.eval_path:
        return cfg.data.eval_path
    beside = Path(cfg.data.path).with_name("eval.jsonl")
    if not beside.is_file():
        raise DataError(f"no held-out data: data.eval_path is null and there is no {beside} (eval.jsonl "
                        "beside data.path); set data.eval_path or pass --data")
    return str(beside)


def check_target_of(cfg: TrainConfig, checkpoint: str | Path) -> None:
    """Refuse, in one line and before any model loads, a checkpoint or export trained for a target of
    another shape than the config's (its weights would not fit it), or a drafter of another kind than the
    config's model.kind (its untrained reference row would be another kind's)."""
    if is_export(checkpoint):
        exported = json.loads((Path(checkpoint) / "config.json").read_text())
        trained = {name: exported.get(name) for name in TARGET_SHAPE}
        dspark = export_dspark_args(exported)
    else:
        step_dir = find_checkpoint(checkpoint)
        trained = json.loads((step_dir / "meta.json").read_text()).get("drafter_config") or {}
        dspark = checkpoint_dspark_args(step_dir)
    kind = "dflash" if dspark is None else "dspark"
    if kind != cfg.model.kind:
        raise ConfigError("model.kind", f"{checkpoint} is a {kind} drafter, the config's model.kind is "
                          f"{cfg.model.kind}: evaluate it with its own run's config")
    target = target_text_config(cfg.model.target_path)
    changes = {f"target {name}": (trained[name], target.get(name)) for name in TARGET_SHAPE
               if trained.get(name) is not None and target.get(name) != trained[name]}
    if changes:
        raise ConfigError("model.target_path", f"{checkpoint} was trained for another target than "
                          f"{cfg.model.target_path}: {describe(changes)} (the drafter's -> this target's); "
                          "evaluate it with its own run's config")


def trained_drafter(cfg: TrainConfig, checkpoint: str | Path, target: nn.Module, layer_ids: list[int]
                    ) -> DFlashDrafter:
    """The drafter of a checkpoint (or of a run's output directory: its latest) or of an export."""
    if is_export(checkpoint):
        drafter, exported_ids = load_export(checkpoint, target)
        if exported_ids != layer_ids:
            raise ConfigError("model.target_layer_ids", f"{checkpoint} reads target layers {exported_ids}, "
                              f"the config {layer_ids}: evaluate it with its own run's config")
        return drafter
    trained = build_drafter(cfg, TargetHead.of(target))
    model_state, _, meta = load_checkpoint(find_checkpoint(checkpoint))
    fit_to_checkpoint(trained.cfg, meta, cfg.model.mask_token_id)
    trained.load_trainable_state_dict(model_state)
    return trained


def evaluate(cfg: TrainConfig, checkpoint: str | Path | None, data_path: str | Path, max_new_tokens: int,
             num_prompts: int | None = None, include_target: bool = True, progress: bool = False) -> dict:
    """The figures of each row (trained drafter if a checkpoint or an export is given, untrained drafter,
    prompt lookup, target), each drafting as many tokens a step as the drafter's kind does."""
    if checkpoint is not None:
        # A run's output directory: its latest checkpoint now, the one measured and reported.
        checkpoint = checkpoint if is_export(checkpoint) else find_checkpoint(checkpoint)
        check_target_of(cfg, checkpoint)
    target = load_target(cfg.model.target_path, cfg.model.dtype)
    layer_ids = resolve_layer_ids(cfg, target.config.num_hidden_layers)
    eos = end_of_text_id(target)
    prompts = eval_prompts(data_path, cfg.data.max_length, num_prompts)

    torch.manual_seed(cfg.run.seed)
    drafters = []
    if checkpoint is not None:
        drafters.append(("trained drafter", trained_drafter(cfg, checkpoint, target, layer_ids)))
    torch.manual_seed(cfg.run.seed)
    drafters.append(("untrained drafter", build_drafter(cfg, TargetHead.of(target))))  # cfg's kind: checked
    proposers: list[tuple[str, Proposer]] = []
    for name, drafter in drafters:
        propose, block_size = kind_proposer(drafter)  # the same for every row: both are model.kind's
        proposers.append((name, propose))
    proposers.append(("prompt lookup", prompt_lookup_proposer(block_size)))
    if include_target:
        proposers.append(("target as drafter", target_proposer(target, block_size)))

    rows = []
    for name, propose in proposers:
        stats = AcceptanceStats(name, block_size)
        for i, prompt in enumerate(prompts):
            speculative_decode(target, propose, prompt, layer_ids, block_size, max_new_tokens, eos, stats)
            if progress:
                print(f"\r{name}: prompt {i + 1}/{len(prompts)}  tau {stats.tau:.2f}", end="",
                      file=sys.stderr)
        if progress:
            print(file=sys.stderr)
        rows.append(stats.as_dict())
    return {**drafter_source(checkpoint), "drafter_kind": drafter_kind(drafters[-1][1]),
            "drafts_per_step": block_size - 1, "data": str(data_path), "block_size": cfg.model.block_size,
            "prompts": len(prompts), "max_new_tokens": max_new_tokens, "rows": rows}


def drafter_source(checkpoint: str | Path | None) -> dict:
    """What the trained drafter row measured: `{"checkpoint": the step directory or the export, "step":
    its step}` (an export's from its `dflash_source`, null when it does not record one)."""
    if checkpoint is None:
        return {"checkpoint": None, "step": None}
    if is_export(checkpoint):
        source = json.loads((Path(checkpoint) / "config.json").read_text()).get("dflash_source") or {}
        return {"checkpoint": str(checkpoint), "step": source.get("step")}
    meta = json.loads((Path(checkpoint) / "meta.json").read_text())
    return {"checkpoint": str(checkpoint), "step": meta.get("step")}


def describe_inputs(result: dict) -> str:
    """One line above the table: the drafter's checkpoint and step, the data file and the prompts used."""
    step = "unrecorded" if result["step"] is None else result["step"]
    drafter = ("no trained drafter" if result["checkpoint"] is None else
               f"checkpoint {result['checkpoint']} (step {step})")
    return (f"{drafter}; data {result['data']}: {result['prompts']} prompts, up to "
            f"{result['max_new_tokens']} new tokens each")


def format_table(rows: list[dict], drafts_per_step: int, kind: str) -> str:
    """The rows under a header that says the drafter's kind and the drafts every row makes a step."""
    head = (f"{'proposer':<20} {'tau':>6} {'steps':>6} {'tokens':>7}  "
            f"acceptance by draft position 1..{drafts_per_step} ({kind} drafter: {drafts_per_step} a step)")
    lines = [head, "-" * len(head)]
    for row in rows:
        rates = " ".join(f"{r:.2f}" for r in row["acceptance_by_position"])
        lines.append(f"{row['name']:<20} {row['tau']:>6.2f} {row['verify_steps']:>6} "
                     f"{row['generated_tokens']:>7}  {rates}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_ops.evaluate",
        description="Mean acceptance length (tau) of a drafter under greedy speculative decoding.",
    )
    parser.add_argument("--config", help="the training config (YAML); default: the checkpoint's own "
                                         "(its config.yaml)")
    parser.add_argument("--checkpoint", help="a checkpoint directory, a run's output directory (its latest) "
                                             "or an export directory (dflash_ops.export's); without it "
                                             "only the reference rows are computed")
    parser.add_argument("--data", help="held-out JSON lines (default: data.eval_path, else eval.jsonl next "
                                       "to data.path)")
    parser.add_argument("--num-prompts", type=int, help="evaluate only the first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="tokens to generate per prompt (default 64)")
    parser.add_argument("--no-target-row", action="store_true",
                        help="skip the target-as-drafter reference row")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        parser.error("--max-new-tokens and --num-prompts must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        config_path = args.config
        if config_path is None:
            if args.checkpoint is None:
                parser.error("give --config, or --checkpoint (a checkpoint carries its run's config)")
            if is_export(args.checkpoint):
                raise ConfigError("config", f"{args.checkpoint} is an export, which carries no training "
                                  "config: give --config (its run's)")
            config_path = find_checkpoint(args.checkpoint) / "config.yaml"
        cfg = load_config(config_path, training=False)  # reads a run: trains nothing, writes nothing
        data_path = heldout_path(cfg, args.data)
        result = evaluate(cfg, args.checkpoint, data_path, args.max_new_tokens, args.num_prompts,
                        include_target=not args.no_target_row, progress=sys.stderr.isatty() and not args.json)
    except (ConfigError, DataError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print(describe_inputs(result))
        print(format_table(result["rows"], result["drafts_per_step"], result["drafter_kind"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
