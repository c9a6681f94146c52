"""Shared fixtures: a tiny Qwen3 target created on disk, and a small JSON-lines data set."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

TINY_TARGET = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def make_tiny_target(path: Path, seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised tiny Qwen3ForCausalLM at `path` and return it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**{**TINY_TARGET, **overrides})
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def write_dataset(path: Path, n_rows: int = 32, vocab_size: int = 128, min_len: int = 24, max_len: int = 48,
                  seed: int = 0) -> Path:
    """Rows of a learnable toy language: prompt of random tokens, response counting up mod 96."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(n_rows):
            length = rng.randint(min_len, max_len)
            prompt_len = rng.randint(4, 8)
            start = rng.randrange(96)
            prompt = [rng.randrange(96, vocab_size - 1) for _ in range(prompt_len)]
            response = [(start + i) % 96 for i in range(length - prompt_len)]
            f.write(json.dumps({"input_ids": prompt + response,
                                "loss_mask": [0] * prompt_len + [1] * len(response)}) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """Directory of a tiny Qwen3 target (4 layers, hidden 32, vocab 128), shared by the session."""
    return make_tiny_target(tmp_path_factory.mktemp("target") / "target")


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data") / "train.jsonl")


@pytest.fixture(scope="session")
def tiny_eval_dataset(tmp_path_factory) -> Path:
    """Held-out rows of the same toy language (another seed)."""
    return write_dataset(tmp_path_factory.mktemp("data") / "eval.jsonl", n_rows=4, seed=1)


def _tiny_config_dict(target_path: Path, data_path: Path, output_dir: Path, **sections) -> dict:
    raw = {
        "model": {"target_path": str(target_path), "num_draft_layers": 1, "block_size": 4,
                  "dtype": "float32"},
        "data": {"path": str(data_path), "max_length": 48, "batch_size": 4, "max_anchors": 8},
        "optim": {"lr": 3e-3, "warmup_ratio": 0.05, "total_steps": 20},
        "run": {"output_dir": str(output_dir), "save_every": 5, "keep_checkpoints": 2, "seed": 0},
        "pipeline": {"device": "cpu"},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


@pytest.fixture
def tiny_config(tiny_target, tiny_dataset):
    """Factory: `tiny_config(output_dir, run={...}, ...)` -> a config mapping for the tiny target
    and data set; keyword arguments update individual sections."""

    def make(output_dir: Path, **sections) -> dict:
        return _tiny_config_dict(tiny_target, tiny_dataset, output_dir, **sections)

    return make


@pytest.fixture
def make_target(tmp_path):
    """Factory: `make_target(name, **Qwen3Config overrides)` -> a fresh tiny target directory."""
    return lambda name="target", **overrides: make_tiny_target(tmp_path / name, **overrides)
