"""A real engine in the loop: vLLM (its CPU build, in the venv of `make serve-check`) serves the tiny
demo target with an exported drafter through its offline API.

A drafter trained briefly on the tiny demo assets is exported (float32); on the held-out prompts,
vLLM's greedy output with the drafter must equal vLLM's output for the target alone, and both must
equal `dflash_ops.evaluate`'s decoding (the target's greedy output); vLLM's drafts must be our verify
steps and its accepted tokens per draft position our accepted drafts, count for count.
Marked `serve`: heavy (two engine starts), so it runs only under `make serve-check` (`pytest -m
serve`), and skips, naming that target, while the venv is missing.
"""

from __future__ import annotations

import pytest

from benchmarks.serve import format_table, serve_venv_problem, side_by_side, train_tiny_drafter

pytestmark = pytest.mark.serve
MAX_NEW_TOKENS = 40
# A drafter whose one layer slides: a query sees the 5 positions up to itself (docs/SERVING.md). All its
# layers slide, which vLLM's V1 runner (its CPU path) serves; mixed full and sliding layers need the V2
# runner, which needs Triton (CUDA builds only), so for those tests/dflash/serve/test_engine_causality.py
# is the check.
SLIDING = {"layer_types": ["sliding_attention"], "sliding_window": 5}


def serve(tmp_path_factory, name: str, model: dict | None = None) -> dict:
    problem = serve_venv_problem()
    if problem:
        pytest.skip(problem)
    workdir = tmp_path_factory.mktemp(name)
    config, run = train_tiny_drafter(workdir, model=model)
    result = side_by_side(config, run, workdir, max_new_tokens=MAX_NEW_TOKENS)
    print(format_table(result))
    return result


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return serve(tmp_path_factory, "serve")


@pytest.fixture(scope="module")
def served_sliding(tmp_path_factory):
    return serve(tmp_path_factory, "serve-sliding", SLIDING)


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


def test_a_sliding_window_drafter_is_served_as_it_was_trained(served_sliding):
    """vLLM's drafts of a sliding layer are ours only if it attends as the trainer did (causal, the
    window p-W < k <= p): an export that says `is_causal: false` makes current engines attend both
    ways, and the accepted drafts differ while the output stays the target's."""
    ours, alone = served_sliding["ours"], served_sliding["target_alone"]
    [run] = served_sliding["dflash"].values()
    assert run["outputs"] == alone["outputs"] == ours["outputs"]
    spec = run["spec_decode"]
    assert spec["num_drafts"] == ours["verify_steps"]
    assert spec["accepted_per_position"] == ours["accepted_by_position"]
    assert ours["accepted_by_position"][0] > ours["verify_steps"] // 4  # it drafts what the target keeps
