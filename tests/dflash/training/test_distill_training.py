"""`loss.kind` in the trainer: the target's capture carries its last hidden state, whose head gives the
target's own logits; a step's loss is the dense mix of the drafter's and the target's distributions on the
blocks the step drew; a run trains and records it; a feature cache of another kind is refused."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_ops.core.config import ConfigError, config_from_dict
from dflash_ops.core.loss_section import capture_layer_ids
from dflash_ops.data.target import TargetHead, load_target, step_features
from dflash_ops.model.distill import split_features, target_rows
from dflash_ops.run.main import run_single_process
from dflash_ops.training.trainer import DrafterTrainer, build_drafter, resolve_layer_ids


def _examples(n=3, length=20, vocab=128):
    from dflash_ops.data.examples import Example

    g = torch.Generator().manual_seed(5)
    def mask(n: int) -> torch.Tensor:
        return torch.cat([torch.zeros(4, dtype=torch.int64), torch.ones(n - 4, dtype=torch.int64)])

    return [Example(torch.randint(vocab - 1, (length - i,), generator=g), mask(length - i)) for i in range(n)]


def test_the_captured_last_layer_through_the_head_is_the_targets_own_logits(tiny_config, tmp_path):
    cfg = config_from_dict(tiny_config(tmp_path / "run", loss={"kind": "tvd"}))
    target = load_target(cfg.model.target_path)
    n_layers = target.config.num_hidden_layers
    layer_ids = resolve_layer_ids(cfg, n_layers)
    ids = capture_layer_ids(layer_ids, n_layers, cfg.loss.mix)
    assert ids == [*layer_ids, n_layers - 1]
    examples = _examples()
    batch = step_features(target, examples, ids, None, torch.device("cpu"))
    hidden = target.config.hidden_size
    assert batch["features"].shape[1] == (len(layer_ids) + 1) * hidden
    drafter_part, last = split_features(batch["features"], hidden, len(layer_ids))
    plain = step_features(target, examples, layer_ids, None, torch.device("cpu"))["features"]
    assert torch.equal(drafter_part, plain), "the drafter's features are unchanged"
    with torch.no_grad():
        start = 0
        for example in examples:
            n = example.input_ids.numel()
            logits = target(input_ids=example.input_ids[None]).logits[0]
            torch.testing.assert_close(target.lm_head(last[start:start + n]), logits, rtol=1e-5, atol=1e-5)
            start += n


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_a_steps_loss_is_the_dense_mix_on_the_blocks_it_drew(tiny_config, tmp_path, weighting):
    raw = tiny_config(tmp_path / "run", loss={"kind": "mix", "weights": {"ce": 0.1, "kl": 0.3, "tvd": 0.6}},
                      optim={"loss_weighting": weighting}, model={"loss_chunk_size": 5})
    cfg = config_from_dict(raw)
    target = load_target(cfg.model.target_path)
    head = TargetHead.of(target)
    n_layers = target.config.num_hidden_layers
    ids = capture_layer_ids(resolve_layer_ids(cfg, n_layers), n_layers, cfg.loss.mix)
    batch = step_features(target, _examples(), ids, None, torch.device("cpu"))
    torch.manual_seed(0)
    trainer = DrafterTrainer(build_drafter(cfg, head), cfg)
    drafter = trainer.drafter
    # The reference: the same anchors (a copy of the generator), the dense formulas on full logits.
    generator = torch.Generator()
    generator.set_state(trainer.anchor_generator.get_state())
    saved = trainer.anchor_generator
    trainer.anchor_generator = generator
    parts, _ = trainer.layout(batch["cu_seqlens"], batch["position_ids"], batch["input_ids"],
                              batch["loss_mask"])
    trainer.anchor_generator = saved
    context, last = split_features(batch["features"], drafter.cfg.hidden_size,
                                   drafter.cfg.num_target_features)
    total_weight = sum(b.weights.sum() for _, _, b, _ in parts)
    expected = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for start, end, blocks, _ in parts:
            out = drafter(context[start:end], batch["position_ids"][start:end], blocks.block_input_ids,
                          blocks.block_positions, blocks.attention_mask)
            rows = blocks.scored_rows
            log_q = torch.log_softmax(drafter.logits(out[rows]).double(), -1)
            p = torch.softmax(drafter.logits(last[start:end][target_rows(blocks)[rows]]).double(), -1)
            ce = -log_q.gather(1, blocks.labels[rows, None]).squeeze(1)
            mixed = 0.1 * ce + 0.3 * (p * (p.log() - log_q)).sum(-1) + 0.6 * (log_q.exp() - p).abs().sum(-1)
            w = blocks.weights[rows].double()
            if weighting == "dpace":
                from dflash_ops.model.loss import dpace_row_weights
                w = dpace_row_weights(ce.float(), rows, blocks.weights.numel(), drafter.cfg.block_size,
                                      cfg.optim.dpace_alpha).double()
            expected += (w * mixed).sum()
    expected /= total_weight.double()
    result = trainer.train_step(**batch)
    assert result.loss == pytest.approx(float(expected), rel=1e-5)


def test_a_run_trains_with_a_mix_and_the_loss_goes_down(tiny_config, tmp_path, capsys):
    raw = tiny_config(tmp_path / "run", loss={"kind": "mix", "weights": {"ce": 0.1, "tvd": 0.9}},
                      optim={"total_steps": 12, "lr": 3e-3}, run={"save_every": 100})
    assert run_single_process(config_from_dict(raw)) == 0
    steps = [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"step"' in line]
    losses = [r["loss"] for r in steps if r.get("event") == "step"]
    assert len(losses) == 12 and all(loss == loss for loss in losses)
    assert sum(losses[-3:]) < sum(losses[:3])


def test_the_config_checks_the_kind_and_its_weights(tiny_config, tmp_path):
    assert config_from_dict(tiny_config(tmp_path)).loss.mix == {"ce": 1.0}
    for loss, key in [({"kind": "jsd"}, "loss.kind"), ({"kind": "mix"}, "loss.weights"),
                      ({"kind": "mix", "weights": {"ce": 1, "l2": 1}}, "loss.weights"),
                      ({"kind": "tvd", "weights": {"tvd": 1}}, "loss.weights")]:
        with pytest.raises(ConfigError) as err:
            config_from_dict(tiny_config(tmp_path, loss=loss))
        assert err.value.key == key


def test_the_feature_cache_carries_the_last_hidden_state_and_refuses_another_kind(tiny_config, tmp_path,
                                                                                   capsys):
    from dflash_ops.data.capture import capture
    from dflash_ops.data.feature_cache import MANIFEST, check_cache

    class Log:
        def emit(self, event, **fields):
            pass

    out = tmp_path / "cache"
    raw = tiny_config(tmp_path / "run", loss={"kind": "kl"}, optim={"total_steps": 3})
    capture(config_from_dict(raw), out, shard_bytes=20_000, log=Log())
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["layer_ids"] == [2, 3] and manifest["width"] == 2 * 32  # the layer, then the last one
    raw["data"]["features_path"] = str(out)
    assert check_cache(config_from_dict(raw)) == manifest
    assert run_single_process(config_from_dict(raw)) == 0  # the drafter trains from the cache's last column
    raw["loss"] = {"kind": "ce"}
    with pytest.raises(ConfigError) as err:
        check_cache(config_from_dict(raw))
    assert err.value.key == "loss.kind"


def test_validates_memory_model_counts_the_sent_hidden_state_the_targets_logits_and_dsparks_heads(tiny_config,
                                                                                                   tmp_path):
    """At the recipe's shape (Qwen3-8B, 3072 tokens, bf16): one more H-wide feature column per token in the
    queue and on the target rank, the target's last layers run (the capture stops at the last one), the loss
    chunk's float32 distributions, and DSpark's vocab x rank heads with their AdamW state."""
    from dflash_ops.training.memory_fit import QWEN3_8B, drafter_peak, target_peak

    def peaks(**sections):
        raw = tiny_config(tmp_path, **sections)
        raw["model"].update(dtype="bfloat16", block_size=16)
        raw["data"].update(max_length=3072, batch_size=2, max_anchors=512)
        cfg = config_from_dict(raw)
        return dict(drafter_peak(cfg, QWEN3_8B, 0).terms), dict(target_peak(cfg, QWEN3_8B, 0).terms)

    (ce_d, ce_t), (mix_d, mix_t) = peaks(), peaks(loss={"kind": "mix", "weights": {"ce": 0.1, "tvd": 0.9}})
    k = len(resolve_layer_ids(config_from_dict(tiny_config(tmp_path)), 36))
    assert mix_d["feature_queue"] * k == ce_d["feature_queue"] * (k + 1)
    assert mix_t["features_out"] * k == ce_t["features_out"] * (k + 1)
    assert mix_d["loss_chunk"] == ce_d["loss_chunk"] * 40 / 6  # both distributions' float32 tensors
    dspark_d, _ = peaks(model={"kind": "dspark", "markov_rank": 256, "confidence_head": True},
                        loss={"kind": "mix", "weights": {"ce": 0.1, "tvd": 0.9, "bce": 1.0}})
    heads = 2 * 151936 * 256 + 4096 + 256 + 1
    assert dspark_d["adamw_state_fp32"] - mix_d["adamw_state_fp32"] == 8 * heads
    assert dspark_d["drafter_weights_fp32"] - mix_d["drafter_weights_fp32"] == 4 * heads
