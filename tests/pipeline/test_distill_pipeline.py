"""A pipeline whose loss needs the target's distribution: the target rank captures and sends its last hidden
state beside the drafter's layers, and a DSpark drafter trained on it takes the single process's steps."""

from __future__ import annotations

import pytest
import yaml

PIPELINE = {"target_workers": 1, "drafter_workers": 1, "threads_per_worker": 1, "queue_depth": 2}
MODEL = {"kind": "dspark", "markov_rank": 8, "confidence_head": True}
LOSS = {"kind": "mix", "weights": {"ce": 0.1, "tvd": 0.9, "bce": 1.0}}


def dspark_config(write_config, name: str, **sections):
    path = write_config(name, model=MODEL, data={"eval_path": None}, **sections)
    raw = yaml.safe_load(path.read_text())
    raw["loss"] = LOSS  # a section the demo's config does not have
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.slow
def test_a_dspark_pipeline_on_the_targets_distribution_equals_the_single_process(write_config, start_run):
    steps = 6
    single = start_run(dspark_config(write_config, "single", optim={"total_steps": steps}))
    assert single.wait(timeout=240) == 0, single.log_path.read_text()[-3000:]
    config = dspark_config(write_config, "pipeline", optim={"total_steps": steps}, pipeline=PIPELINE)
    pipeline = start_run(config)
    assert pipeline.wait(timeout=240) == 0, pipeline.log_path.read_text()[-3000:]
    expected = [e["loss"] for e in single.events() if e["event"] == "step"]
    got = [e["loss"] for e in pipeline.events() if e["event"] == "step"]
    assert len(got) == steps and got == expected
