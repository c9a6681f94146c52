"""Acceptance length: speculative decoding is lossless; a trained drafter beats an untrained one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_ops.core.config import load_config
from dflash_ops.data.examples import load_examples
from dflash_ops.data.target import load_target
from dflash_ops.serve.evaluate import (
    AcceptanceStats,
    drafter_proposer,
    eval_prompts,
    speculative_decode,
    target_proposer,
)
from dflash_ops.training.checkpoint import latest_checkpoint, load_drafter
from dflash_ops.training.heldout import HeldOutEvaluator
from dflash_ops.training.trainer import resolve_layer_ids

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_target(demo_dir):
    cfg = load_config(demo_dir / "config.yaml")
    target = load_target(cfg.model.target_path)
    prompts = eval_prompts(demo_dir / "data" / "eval.jsonl", cfg.data.max_length, limit=3)
    return cfg, target, resolve_layer_ids(cfg, target.config.num_hidden_layers), prompts


def greedy_reference(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_decoding_equals_greedy_whatever_the_drafts(demo_target):
    cfg, target, layer_ids, prompts = demo_target
    block = cfg.model.block_size
    max_new = 3 * block + 2

    def wrong_drafts(sequence, context):
        """Never the target's choice: its own greedy continuation, each token shifted by one."""
        own = target_proposer(target, block)(sequence, context)
        return [(t + 1) % target.config.vocab_size for t in own]

    for prompt in prompts:
        reference = greedy_reference(target, prompt, max_new)
        perfect, hopeless = AcceptanceStats("target", block), AcceptanceStats("wrong", block)
        assert speculative_decode(target, target_proposer(target, block), prompt, layer_ids, block,
                                  max_new, None, perfect) == reference
        assert speculative_decode(target, wrong_drafts, prompt, layer_ids, block, max_new, None,
                                  hopeless) == reference
        # Every draft of the target itself is accepted (b tokens a step) but the last step's, cut to
        # the budget: tau counts only the tokens the output keeps; none of the wrong drafts is accepted.
        assert perfect.lengths == [block, block, block, 1] and sum(perfect.lengths) == max_new - 1
        assert perfect.tau == (3 * block + 1) / 4 and perfect.generated_tokens == max_new
        assert hopeless.tau == 1.0 and hopeless.verify_steps == max_new - 1
        assert perfect.acceptance_by_position() == [0.75] * (block - 1)
        assert hopeless.acceptance_by_position() == [0.0] * (block - 1)
        # An engine counts the last step's drafts before the cut: all of them accepted.
        assert perfect.accepted == [block - 1] * 4 and perfect.accepted_by_position() == [4] * (block - 1)
        assert hopeless.accepted_by_position() == [0] * (block - 1)


@pytest.mark.slow
def test_trained_drafter_reaches_a_higher_tau(write_config, start_run):
    config = write_config("tau", data={"batch_size": 8, "max_anchors": 32}, optim={"total_steps": 100})
    run = start_run(config)
    assert run.wait(timeout=300) == 0, run.log_path.read_text()[-3000:]
    result = subprocess.run(
        [sys.executable, "-m", "dflash_ops.evaluate", "--config", str(config),
         "--checkpoint", str(run.output_dir), "--max-new-tokens", "32", "--threads", "1", "--no-target-row",
         "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout.splitlines()[-1])["rows"]}
    trained, untrained = rows["trained drafter"]["tau"], rows["untrained drafter"]["tau"]
    assert trained > 1.3 and trained > untrained + 0.25, rows
    assert rows["trained drafter"]["acceptance_by_position"][0] > 0.2
    # Same prompts for every row: each generates the same (greedy) tokens, in its own number of steps.
    assert len({row["generated_tokens"] for row in rows.values()}) == 1
    assert 1.0 < rows["prompt lookup"]["tau"] <= 8.0

    # The held-out replay gives the decoding's tau on the same rows without running the target again.
    cfg = load_config(config)
    target = load_target(cfg.model.target_path)
    drafter, layer_ids = load_drafter(latest_checkpoint(run.output_dir), target)
    examples = load_examples(Path(cfg.data.path).with_name("eval.jsonl"), cfg.data.max_length)
    replayed = HeldOutEvaluator.of(target, examples[:3], layer_ids, cfg.data.max_anchors,
                                   cfg.gamma)(drafter)
    decoded = AcceptanceStats("decoded", cfg.model.block_size)
    eos = target.generation_config.eos_token_id
    for example in examples[:3]:
        mask = example.loss_mask.tolist()
        prompt = example.input_ids[: mask.index(1)].tolist()
        speculative_decode(target, drafter_proposer(drafter), prompt, layer_ids, cfg.model.block_size,
                           len(mask) - len(prompt), eos, decoded)
    assert replayed.stats.lengths == decoded.lengths and replayed.stats.tau > 1.0


def test_evaluate_reports_bad_input_without_a_traceback(demo_dir, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "dflash_ops.evaluate", "--config", str(demo_dir / "config.yaml"),
         "--checkpoint", str(tmp_path / "nowhere")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "no checkpoint at" in result.stderr and "Traceback" not in result.stderr
