"""The mask token cannot stop generation: by default a reserved embedding row, a configured one is
refused when it is a stop or pad token or lies outside the embedding, and a resumed run keeps the
mask its checkpoint was trained with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_ops.core.config import ConfigError, check_against_target, config_from_dict
from dflash_ops.core.mask_token import resolve_mask_token_id
from dflash_ops.run.main import run_single_process
from dflash_ops.training.checkpoint import latest_checkpoint

EOS = "<|endoftext|>"
VOCAB = 128  # the tiny targets' embedding rows


def save_tokenizer(path: Path, n_words: int, pad: str | None = EOS, mask: str | None = None) -> None:
    """A word-level tokenizer of `n_words` words plus its special tokens (eos, pad, mask)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = list(dict.fromkeys(t for t in (EOS, pad, mask) if t))
    vocab = {f"w{i}": i for i in range(n_words - len(specials))}
    vocab.update({token: len(vocab) + i for i, token in enumerate(specials)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=pad,
                            mask_token=mask).save_pretrained(path)


def test_the_default_is_the_first_embedding_row_past_the_tokenizer_not_its_pad_token(make_target):
    # Qwen3's shape: the tokenizer's pad token is its eos <|endoftext|>, the embedding has spare rows.
    target = make_target("qwen3-like")
    save_tokenizer(target, n_words=100)
    assert resolve_mask_token_id(None, target, VOCAB) == 100


def test_without_spare_rows_the_default_is_the_tokenizers_own_mask_token_else_an_error(make_target):
    target = make_target("demo-like")  # the demo's shape: <|mask|> among the tokens, no spare row
    save_tokenizer(target, n_words=VOCAB, pad="<|pad|>", mask="<|mask|>")
    assert resolve_mask_token_id(None, target, VOCAB) == VOCAB - 1

    save_tokenizer(target, n_words=VOCAB, mask=EOS)  # a mask token that is the eos is no better
    with pytest.raises(ValueError, match=r"model.mask_token_id: .* no spare embedding row .* set "
                                         r"model.mask_token_id to"):
        resolve_mask_token_id(None, target, VOCAB)


def test_a_target_without_tokenizer_gets_its_last_embedding_row(tiny_target):
    assert resolve_mask_token_id(None, tiny_target, VOCAB) == VOCAB - 1


@pytest.mark.parametrize(("mask", "reason"), [
    (5, "config.json eos_token_id"), (6, "config.json pad_token_id"),
    (7, "generation_config.json eos_token_id"), (8, "generation_config.json eos_token_id"),
    (VOCAB, r"outside the target's embedding \(ids 0..127\)"),
])
def test_validation_refuses_a_mask_that_stops_generation_or_lies_outside_the_embedding(
        make_target, tiny_config, tmp_path, mask, reason):
    target = make_target("stops", eos_token_id=5, pad_token_id=6)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8], "pad_token_id": 6}))
    raw = tiny_config(tmp_path / "run", model={"target_path": str(target), "mask_token_id": mask})
    fix = "set model.mask_token_id to a reserved embedding row"
    with pytest.raises(ConfigError, match=rf"{reason}.*{fix}") as err:
        check_against_target(config_from_dict(raw))
    assert err.value.key == "model.mask_token_id"
    with pytest.raises(ValueError, match=reason):  # and a trainer that was not validated refuses it too
        resolve_mask_token_id(mask, target, VOCAB)

    raw["model"]["mask_token_id"] = 9
    check_against_target(config_from_dict(raw))
    assert resolve_mask_token_id(9, target, VOCAB) == 9


def test_a_resumed_run_keeps_the_mask_token_its_checkpoint_was_trained_with(tiny_config, tmp_path):
    run_dir = tmp_path / "run"

    def train(total_steps: int, mask_token_id: int | None) -> int:
        raw = tiny_config(run_dir, model={"mask_token_id": mask_token_id},
                          optim={"total_steps": total_steps}, run={"save_every": 2})
        return run_single_process(config_from_dict(raw))

    def trained_mask() -> int:
        meta = json.loads((latest_checkpoint(run_dir) / "meta.json").read_text())
        return meta["drafter_config"]["mask_token_id"]

    # A checkpoint written under another default (here: configured), resumed with the default (127).
    assert train(2, mask_token_id=100) == 0 and trained_mask() == 100
    assert train(4, mask_token_id=None) == 0
    assert latest_checkpoint(run_dir).name.endswith("4") and trained_mask() == 100

    assert train(6, mask_token_id=101) == 2  # a configured mask other than the trained one: refused
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and "model.mask_token_id: 101 differs from 100" in status["error"]
    assert (status["step"], status["last_checkpoint"]) == (4, str(latest_checkpoint(run_dir)))  # kept
    assert trained_mask() == 100
