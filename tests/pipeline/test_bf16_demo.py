"""bf16 against fp32 on the demo: the loss curve of a bf16 run follows the fp32 one."""

from __future__ import annotations

import json

import yaml

from dflash_ops.core.config import config_from_dict
from dflash_ops.run.main import run_single_process

STEPS = 40
# Stated tolerance: every step's bf16 loss within 1 % of the fp32 loss of the same step, and the
# mean of the last 10 steps within 0.5 % (measured: 0.02 % at worst).
STEP_TOLERANCE, TAIL_TOLERANCE = 0.01, 0.005


def demo_losses(demo_dir, output_dir, dtype: str, capsys) -> list[float]:
    raw = yaml.safe_load((demo_dir / "config.yaml").read_text())
    raw["model"]["dtype"] = dtype
    raw["data"].update(batch_size=4, max_anchors=16)
    raw["optim"].update(lr=6e-4, total_steps=STEPS, warmup_ratio=0.05)
    raw["run"].update(output_dir=str(output_dir), save_every=1000, log_every=1)
    capsys.readouterr()
    assert run_single_process(config_from_dict(raw)) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    return [r["loss"] for r in records if r["event"] == "step"]


def test_bf16_loss_curve_stays_within_tolerance_of_fp32(demo_dir, tmp_path, capsys):
    fp32 = demo_losses(demo_dir, tmp_path / "fp32", "float32", capsys)
    bf16 = demo_losses(demo_dir, tmp_path / "bf16", "bfloat16", capsys)
    assert len(fp32) == len(bf16) == STEPS
    assert bf16 != fp32, "the bf16 run computes in bf16"
    worst = max(abs(b - f) / f for b, f in zip(bf16, fp32, strict=True))
    assert worst <= STEP_TOLERANCE, (worst, fp32, bf16)
    tail = abs(sum(bf16[-10:]) - sum(fp32[-10:])) / sum(fp32[-10:])
    assert tail <= TAIL_TOLERANCE, (tail, fp32, bf16)
    assert sum(bf16[-5:]) / 5 < sum(bf16[:5]) / 5, "bf16 learns"
