"""A real engine in the loop: vLLM (its CPU build, in the venv of `make serve-check`) serves the tiny
demo target with an exported drafter through its offline API.

A drafter trained briefly on the tiny demo assets is exported (float32); on the held-out prompts,
vLLM's greedy output with the drafter must equal vLLM's output for the target alone, and both must
equal `dflash.evaluate`'s decoding (the target's greedy output); vLLM's drafts must be our verify
steps and its accepted tokens per draft position our accepted drafts, count for count.
Marked `serve`: heavy (two engine starts), so it runs only under `make serve-check` (`pytest -m
serve`), and skips, naming that target, while the venv is missing.
"""

from __future__ import annotations

import pytest

from benchmarks.serve import format_table, serve_venv_problem, side_by_side, train_tiny_drafter

pytestmark = pytest.mark.serve
MAX_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    problem = serve_venv_problem()
    if problem:
        pytest.skip(problem)
    workdir = tmp_path_factory.mktemp("serve")
    config, run = train_tiny_drafter(workdir)
    result = side_by_side(config, run, workdir, max_new_tokens=MAX_NEW_TOKENS)
    print(format_table(result))
    return result


def test_vllm_with_the_drafter_gives_the_target_alones_greedy_output_on_every_prompt(served):
    alone, ours = served["target_alone"]["outputs"], served["ours"]["outputs"]
    [with_drafter] = served["dflash"].values()
    assert len(alone) == served["prompts"] >= 8
    assert all(0 < len(output) <= MAX_NEW_TOKENS for output in alone)
    # vLLM reads the target as transformers does: its greedy output is ours (the target's greedy).
    assert alone == ours
    for i, (theirs, own) in enumerate(zip(with_drafter["outputs"], alone, strict=True)):
        assert theirs == own, f"prompt {i}: vLLM with the drafter diverges from the target alone"


def test_vllm_verifies_as_many_steps_and_accepts_the_same_drafts_as_dflash_evaluate(served):
    ours = served["ours"]
    [(k, run)] = served["dflash"].items()
    spec = run["spec_decode"]
    assert k == served["block_size"] - 1  # the export's README and docs/SERVING.md: block_size - 1
    assert spec["num_drafts"] == ours["verify_steps"]
    assert spec["num_draft_tokens"] == k * ours["verify_steps"]
    assert spec["accepted_per_position"] == ours["accepted_by_position"]
    assert spec["num_accepted_tokens"] == sum(ours["accepted_by_position"])
    # A drafter that proposes something the target keeps, so that the counts above compare acceptances.
    assert ours["accepted_by_position"][0] > ours["verify_steps"] // 4 and ours["tau"] > 1.3
    # The target alone drafts nothing.
    assert served["target_alone"]["spec_decode"]["num_drafts"] == 0
