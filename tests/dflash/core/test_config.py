"""Config loading and `python -m dflash_ops.config validate`: bad input fails with a clear message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash_ops.core.config import ConfigError, config_from_dict, dump_config, load_config

REPO = Path(__file__).resolve().parents[3]


def write(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_good_config_loads_and_round_trips(tiny_config, tmp_path):
    cfg = load_config(write(tmp_path, tiny_config(tmp_path / "run")))
    assert cfg.model.block_size == 4 and cfg.optim.lr == pytest.approx(3e-3)
    assert cfg.pipeline.is_multi_process is False
    again = config_from_dict(yaml.safe_load(dump_config(cfg)))
    assert again == cfg


def test_sliding_window_layers_load_and_round_trip(tiny_config, tmp_path):
    raw = tiny_config(tmp_path / "run", model={"num_draft_layers": 3, "sliding_window": 16,
                                               "layer_types": ["sliding_attention", "full_attention",
                                                               "sliding_attention"]})
    cfg = load_config(write(tmp_path, raw))
    assert cfg.model.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert cfg.model.sliding_window == 16
    assert config_from_dict(yaml.safe_load(dump_config(cfg))) == cfg
    assert load_config(write(tmp_path, tiny_config(tmp_path / "run"))).model.layer_types is None  # all full


def test_example_config_is_valid_apart_from_its_target():
    load_config(REPO / "configs" / "tiny-cpu.yaml", check_target=False)


@pytest.mark.parametrize(("section", "values", "message"), [
    ("model", {"block_size": "16"}, "model.block_size: expected int, got '16'"),
    ("model", {"block_size": 1}, "model.block_size: must be >= 2"),
    ("model", {"dtype": "float16"}, "model.dtype: must be one of float32, bfloat16, got 'float16'"),
    ("model", {"num_draft_layers": True}, "model.num_draft_layers: expected int, got True"),
    ("model", {"target_layer_ids": [1, "x"]}, "model.target_layer_ids"),
    ("model", {"blocksize": 8}, "model: unknown key(s) blocksize"),
    ("model", {"target_rows_per_pass": 0}, "model.target_rows_per_pass: must be >= 1, got 0"),
    ("model", {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8},
     "model.layer_types: must have model.num_draft_layers (1) entries, got ['full_attention', 'sliding"),
    ("model", {"layer_types": ["sliding"]},
     "model.layer_types: takes full_attention or sliding_attention, got ['sliding']"),
    ("model", {"layer_types": "sliding_attention"}, "model.layer_types: expected list[str] | None"),
    ("model", {"layer_types": ["sliding_attention"]},
     "model.sliding_window: must be set (>= 1, tokens) for sliding_attention layers, got None"),
    ("model", {"layer_types": ["sliding_attention"], "sliding_window": 0},
     "model.sliding_window: must be >= 1 (tokens), got 0"),
    ("model", {"sliding_window": 64},
     "model.sliding_window: applies to no layer: make some of model.layer_types sliding_attention"),
    ("data", {"max_length": 3}, "model.block_size: 4 does not fit in data.max_length 3"),
    ("optim", {"lr": "fast"}, "optim.lr: expected float, got 'fast'"),
    ("optim", {"warmup_ratio": 1.5}, "optim.warmup_ratio: must be in [0, 1), got 1.5"),
    ("run", {"resume": "yes"}, "run.resume: expected bool, got 'yes'"),
    ("pipeline", {"device": "tpu"}, "pipeline.device: must be one of cpu, cuda"),
    ("pipeline", {"target_gpus": [0, 1], "drafter_gpus": [1]}, "shares GPUs [1]"),
    # A GPU layout on device cpu cannot start: validate must say so before a deploy stops a run.
    ("pipeline", {"target_gpus": [0], "drafter_gpus": [1]}, "need device cuda"),
    ("pipeline", {"device": "cuda", "target_gpus": [0, 0], "drafter_gpus": [1]}, "lists a GPU twice"),
])
def test_bad_values_name_the_key_and_value(tiny_config, tmp_path, section, values, message):
    raw = tiny_config(tmp_path / "run", **{section: values})
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, raw))
    assert message in str(caught.value)


def test_unknown_section_missing_section_and_missing_key(tiny_config, tmp_path):
    raw = tiny_config(tmp_path / "run")
    with pytest.raises(ConfigError, match="unknown section"):
        config_from_dict({**raw, "extra": {}})
    with pytest.raises(ConfigError, match="missing section data"):
        config_from_dict({"model": raw["model"]})
    del raw["model"]["target_path"]
    with pytest.raises(ConfigError, match="model: missing required key"):
        config_from_dict(raw)


def test_checks_against_the_target_on_disk(tiny_config, tmp_path):
    with pytest.raises(ConfigError, match=r"target_layer_ids: \[1, 4\] out of range .* 4 layers"):
        load_config(write(tmp_path, tiny_config(tmp_path / "run", model={"target_layer_ids": [1, 4]})))
    with pytest.raises(ConfigError, match=r"model.mask_token_id: 128 is outside .* \(ids 0..127\)"):
        load_config(write(tmp_path, tiny_config(tmp_path / "run", model={"mask_token_id": 128})))
    with pytest.raises(ConfigError, match="model.target_path: no model at"):
        raw = tiny_config(tmp_path / "run", model={"target_path": str(tmp_path / "nope")})
        load_config(write(tmp_path, raw))


def validate(path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_ops.config", "validate", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env=env)


def test_validate_cli_exit_codes_and_messages(tiny_config, tmp_path):
    good = validate(write(tmp_path, tiny_config(tmp_path / "run")))
    assert good.returncode == 0, good.stderr

    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    no_target = tiny_config(tmp_path / "run", model={"target_path": str(tmp_path / "nope")})
    bad = validate(write(bad_dir, no_target))
    assert bad.returncode == 2
    assert "model.target_path: no model at" in bad.stderr
    assert "Traceback" not in bad.stderr

    (bad_dir / "broken.yaml").write_text("model: [unclosed\n")
    broken = validate(bad_dir / "broken.yaml")
    assert broken.returncode == 2 and "not valid YAML" in broken.stderr and "Traceback" not in broken.stderr

    missing = validate(bad_dir / "absent.yaml")
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def test_validate_refuses_a_gpu_layout_beyond_the_visible_gpus(tiny_config, tmp_path):
    """The deploy validates in the container before it stops the running run: a layout that the
    container's GPUs cannot hold must fail there, not when the new run starts."""
    layout = {"device": "cuda", "target_gpus": [0, 1], "drafter_gpus": [2]}
    raw = tiny_config(tmp_path / "run", pipeline=layout)
    path = write(tmp_path, raw)
    env = {"PATH": "/usr/bin:/bin"}
    fits = validate(path, env={**env, "CUDA_VISIBLE_DEVICES": "0,1,2"})
    assert fits.returncode == 0, fits.stderr
    too_few = validate(path, env={**env, "CUDA_VISIBLE_DEVICES": "0"})
    assert too_few.returncode == 2
    assert "pipeline.target_gpus: GPUs [1] do not exist here (1 visible" in too_few.stderr
