"""Sliding-window draft layers: what a block sees through one, and that they train, checkpoint and
resume only as they were trained."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from dflash_ops.core.config import config_from_dict
from dflash_ops.data.target import load_target
from dflash_ops.model.drafter import DFlashDrafter, DrafterConfig
from dflash_ops.model.loss import build_block_batch
from dflash_ops.run.main import run_single_process
from dflash_ops.training.checkpoint import latest_checkpoint, load_checkpoint, load_drafter

BLOCK, VOCAB, WINDOW = 4, 50, 3
LENGTH, ANCHOR = 16, 10
SLIDING = {"num_draft_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}


def one_layer_drafter(layer_type: str) -> DFlashDrafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=4, num_layers=1, num_target_features=2, block_size=BLOCK,
                        mask_token_id=VOCAB - 1, vocab_size=VOCAB, layer_types=[layer_type],
                        sliding_window=WINDOW if layer_type == "sliding_attention" else None)
    return DFlashDrafter(cfg, nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB, bias=False)).eval()


def changed_queries(drafter: DFlashDrafter, context_row: int | None = None, block_offset: int | None = None):
    """Which block offsets' outputs change when one context row or one block token changes; one
    document, one block at ANCHOR, through the training path (the block-sparse mask)."""
    g = torch.Generator().manual_seed(0)
    features = torch.randn(LENGTH, 32, generator=g)
    input_ids = torch.randint(0, VOCAB - 1, (LENGTH,), generator=g)
    cu_seqlens = torch.tensor([0, LENGTH], dtype=torch.int32)
    batch = build_block_batch(input_ids, torch.ones_like(input_ids), cu_seqlens, torch.arange(LENGTH),
                              [torch.tensor([ANCHOR])], BLOCK, VOCAB - 1, gamma=2.0)

    def blocks(features, block_ids):
        with torch.no_grad():
            return drafter(features, batch.context_pos, block_ids, batch.block_positions, batch.sparse_mask)

    base = blocks(features, batch.block_input_ids)
    features, block_ids = features.clone(), batch.block_input_ids.clone()
    if context_row is not None:
        features[context_row] += 10.0
    if block_offset is not None:
        block_ids[block_offset] = (block_ids[block_offset] + 1) % (VOCAB - 1)
    after = blocks(features, block_ids)
    for offset in range(BLOCK):  # a key outside the window leaves a query bit for bit as it was
        assert torch.equal(after[offset], base[offset]) or not torch.allclose(after[offset], base[offset])
    return [not torch.equal(after[offset], base[offset]) for offset in range(BLOCK)]


def test_a_sliding_layer_shows_each_query_the_window_that_ends_at_itself():
    sliding = one_layer_drafter("sliding_attention")
    # The query at offset i (position ANCHOR + i) sees positions ANCHOR + i - 2 .. ANCHOR + i.
    assert changed_queries(sliding, context_row=ANCHOR - WINDOW) == [False] * BLOCK
    assert changed_queries(sliding, context_row=ANCHOR - WINDOW + 1) == [True, False, False, False]
    assert changed_queries(sliding, context_row=ANCHOR - 1) == [True, True, False, False]
    # Inside the block: causal, and the last query no longer sees the anchor.
    assert changed_queries(sliding, block_offset=0) == [True, True, True, False]
    assert changed_queries(sliding, block_offset=2) == [False, False, True, True]
    # A full attention layer sees the whole prefix and the whole block.
    full = one_layer_drafter("full_attention")
    assert changed_queries(full, context_row=0) == [True] * BLOCK
    assert changed_queries(full, block_offset=2) == [True] * BLOCK


def train(raw: dict, capsys) -> tuple[int, list[dict]]:
    capsys.readouterr()
    code = run_single_process(config_from_dict(raw))
    return code, [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_mixed_layer_types_train_and_their_checkpoint_keeps_them(tiny_config, tiny_target, tiny_eval_dataset,
                                                                 tmp_path, capsys):
    raw = tiny_config(tmp_path / "run", model=SLIDING, optim={"total_steps": 60, "lr": 3e-2},
                      run={"save_every": 1000, "eval_every": 30},
                      data={"max_anchors": 16, "eval_path": str(tiny_eval_dataset)})
    code, records = train(raw, capsys)
    assert code == 0
    losses = [r["loss"] for r in records if r["event"] == "step"]
    assert len(losses) == 60 and sum(losses[-5:]) < 0.9 * sum(losses[:5]), losses
    heldout = [r for r in records if r["event"] == "heldout"]
    assert [r["step"] for r in heldout] == [30, 60] and all(r["heldout_tau"] >= 1 for r in heldout)
    _, _, meta = load_checkpoint(latest_checkpoint(tmp_path / "run"))
    assert meta["drafter_config"]["layer_types"] == SLIDING["layer_types"]
    assert meta["drafter_config"]["sliding_window"] == SLIDING["sliding_window"]
    drafter, _ = load_drafter(latest_checkpoint(tmp_path / "run"), load_target(tiny_target))
    assert (drafter.cfg.layer_types, drafter.cfg.sliding_window) == (SLIDING["layer_types"], 8)


@pytest.mark.parametrize(("model", "message"), [
    ({"layer_types": ["full_attention", "full_attention"], "sliding_window": None},
     "model.layer_types: ['full_attention', 'full_attention'] differs from ['sliding_attention', "
     "'full_attention'], what the checkpoint was trained with"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "model.layer_types: "),
    ({"sliding_window": 16}, "model.sliding_window: 16 differs from 8, what the checkpoint was trained with"),
])
def test_a_resume_refuses_other_layer_types_or_window_and_continues_with_the_trained_ones(
        tiny_config, tmp_path, capsys, model, message):
    run_dir = tmp_path / "run"
    raw = tiny_config(run_dir, model=SLIDING, optim={"total_steps": 4}, run={"max_steps_per_run": 2})
    assert train(raw, capsys)[0] == 0
    saved = latest_checkpoint(run_dir)

    other = tiny_config(run_dir, model={**SLIDING, **model}, optim={"total_steps": 4})
    code, records = train(other, capsys)
    assert code == 2
    assert message in records[-1]["message"]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and message in status["error"]
    assert latest_checkpoint(run_dir) == saved and saved.name.endswith("2")

    code, records = train(raw, capsys)
    assert code == 0 and [r["step"] for r in records if r["event"] == "step"] == [3, 4]


def test_a_checkpoint_from_before_layer_types_resumes_as_all_full_attention(tiny_config, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train(tiny_config(run_dir, optim={"total_steps": 4}, run={"max_steps_per_run": 2}), capsys)[0] == 0
    meta_path = latest_checkpoint(run_dir) / "meta.json"
    meta = json.loads(meta_path.read_text())
    for key in ("layer_types", "sliding_window"):
        del meta["drafter_config"][key]
    meta_path.write_text(json.dumps(meta))
    sliding = tiny_config(run_dir, model={"layer_types": ["sliding_attention"], "sliding_window": 8},
                          optim={"total_steps": 4})
    assert train(sliding, capsys)[0] == 2
    assert train(tiny_config(run_dir, optim={"total_steps": 4}), capsys)[0] == 0
