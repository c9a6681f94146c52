"""data.min_loss_tokens: SpecForge's minimum-length filter. The training data loses exactly the examples
with fewer loss tokens than the minimum (counted after data.max_length), the held-out set none, and a
bad value or a data set the filter empties is refused before training."""

from __future__ import annotations

import json

import pytest
import yaml

from dflash_ops.core.config import ConfigError, config_from_dict
from dflash_ops.data.examples import DataError, load_examples, training_examples
from dflash_ops.run.main import main as train_main
from dflash_ops.training.drafter_run import heldout_examples

# (prompt tokens, loss tokens) of each row: around the minimum of 16 (SpecForge's 2 * block_size for b = 8).
SHAPES = [(4, 15), (4, 16), (2, 17), (6, 3), (3, 40), (5, 0), (8, 16)]
MINIMUM = 16


def write_rows(path, shapes=SHAPES):
    rows = []
    for index, (prompt, loss) in enumerate(shapes):
        # The first token says which row it is, so a kept example names its row.
        rows.append({"input_ids": [index] + [50] * (prompt - 1) + [60] * loss,
                     "loss_mask": [0] * prompt + [1] * loss})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def kept_rows(examples) -> list[int]:
    return [int(example.input_ids[0]) for example in examples]


def test_it_drops_exactly_the_examples_with_fewer_loss_tokens(tmp_path):
    data = write_rows(tmp_path / "train.jsonl")
    assert kept_rows(load_examples(data, max_length=64)) == list(range(len(SHAPES)))  # off: every row
    kept = kept_rows(load_examples(data, max_length=64, min_loss_tokens=MINIMUM))
    assert kept == [i for i, (_, loss) in enumerate(SHAPES) if loss >= MINIMUM] == [1, 2, 4, 6]
    # Counted after the truncation to max_length, as SpecForge counts: at 19 tokens row 1 keeps 15 of its
    # 16 loss tokens and row 6 11, rows 2 and 4 keep 17 and 16.
    assert kept_rows(load_examples(data, max_length=19, min_loss_tokens=MINIMUM)) == [2, 4]


def test_the_config_takes_null_or_a_positive_count(tmp_path, tiny_config):
    data = write_rows(tmp_path / "train.jsonl")
    raw = tiny_config(tmp_path / "run", data={"path": str(data), "max_length": 64})
    assert config_from_dict(raw).data.min_loss_tokens is None
    cfg = config_from_dict({**raw, "data": {**raw["data"], "min_loss_tokens": MINIMUM}})
    assert kept_rows(training_examples(cfg.data)) == [1, 2, 4, 6]
    for bad in (0, -2, True, "16"):
        with pytest.raises(ConfigError) as refused:
            config_from_dict({**raw, "data": {**raw["data"], "min_loss_tokens": bad}})
        assert refused.value.key == "data.min_loss_tokens"


def test_the_held_out_set_is_not_filtered(tmp_path, tiny_config):
    data = write_rows(tmp_path / "train.jsonl")
    raw = tiny_config(tmp_path / "run", data={"path": str(data), "max_length": 64, "eval_path": str(data),
                                              "eval_examples": 16, "min_loss_tokens": MINIMUM})
    assert kept_rows(heldout_examples(config_from_dict(raw), vocab_size=128)) == list(range(len(SHAPES)))


def test_a_training_whose_data_the_filter_empties_is_refused(tmp_path, tiny_config, capsys):
    data = write_rows(tmp_path / "short.jsonl", [(4, 3), (2, 15)])
    raw = tiny_config(tmp_path / "run",
                      data={"path": str(data), "max_length": 64, "min_loss_tokens": MINIMUM})
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert train_main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "data.min_loss_tokens; 2 fewer" in err and "Traceback" not in err
    assert not list((tmp_path / "run").glob("step_*"))
    with pytest.raises(DataError, match="holds no examples with 16 loss tokens or more"):
        load_examples(data, max_length=64, min_loss_tokens=MINIMUM)
