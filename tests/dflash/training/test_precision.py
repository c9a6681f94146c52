"""bf16 training: bf16 compute over fp32 master weights and AdamW state, around a frozen bf16 target."""

from __future__ import annotations

import torch

from dflash_ops.core.config import config_from_dict
from dflash_ops.data.target import TargetHead, load_target, target_hidden_states
from dflash_ops.training.trainer import DrafterTrainer, build_drafter, compute_precision


def test_bf16_steps_at_the_papers_lr_move_every_trainable_element(tiny_target, tiny_config, tmp_path):
    # Pure bf16 weights lost these updates: every RMSNorm weight (1.0, where a bf16 ulp is 2^-7)
    # stayed put, and a few % of the other elements too.
    steps = 20
    cfg = config_from_dict(tiny_config(tmp_path, model={"dtype": "bfloat16"},
                                       optim={"lr": 6e-4, "warmup_ratio": 0.0, "total_steps": steps}))
    target = load_target(tiny_target, "bfloat16")
    torch.manual_seed(0)
    trainer = DrafterTrainer(build_drafter(cfg, TargetHead.of(target)), cfg)
    drafter = trainer.drafter
    assert drafter.embed_tokens.weight.dtype == drafter.lm_head.weight.dtype == torch.bfloat16
    before = {name: value.clone() for name, value in drafter.trainable_state_dict().items()}
    assert all(value.dtype == torch.float32 for value in before.values()), "fp32 master weights"

    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        input_ids = torch.randint(0, 100, (2, 24), generator=g)
        packed = target_hidden_states(target, input_ids, torch.ones_like(input_ids), [2])
        assert packed.features.dtype == torch.bfloat16
        trainer.train_step(packed.features, packed.cu_seqlens, packed.position_ids,
                                    packed.pack(input_ids), torch.ones(48, dtype=torch.int64))

    for name, value in drafter.trainable_state_dict().items():
        unchanged = (value == before[name]).sum().item()
        assert unchanged == 0, f"{name}: {unchanged} of {value.numel()} elements never moved"
    moments = [m for state in trainer.optimizer.state.values()
               for m in (state["exp_avg"], state["exp_avg_sq"])]
    assert moments and all(m.dtype == torch.float32 for m in moments)


def test_bf16_compute_runs_the_drafter_in_bf16(tiny_target, tiny_config, tmp_path):
    cfg = config_from_dict(tiny_config(tmp_path, model={"dtype": "bfloat16"}))
    drafter = build_drafter(cfg, TargetHead.of(load_target(tiny_target, "bfloat16")))
    features = torch.randn(8, drafter.fc.in_features)
    with compute_precision(cfg, torch.device("cpu")):
        projected = drafter.fc(features)
    assert drafter.fc.weight.dtype == torch.float32 and projected.dtype == torch.bfloat16
    fp32 = config_from_dict(tiny_config(tmp_path))
    with compute_precision(fp32, torch.device("cpu")):
        assert drafter.fc(features).dtype == torch.float32

