"""A drafter rank reads only the target's config, embedding and lm_head, never the whole model."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from dflash_ops.core.config import config_from_dict
from dflash_ops.data.target import TargetHead, load_target, load_target_head
from dflash_ops.training.trainer import build_drafter


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_head_equals_the_loaded_targets(make_target, dtype):
    path = make_target()
    target = load_target(path, dtype)
    head = load_target_head(path, dtype)
    assert torch.equal(head.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(head.lm_head.weight, target.get_output_embeddings().weight)
    assert head.embed_tokens.weight.dtype == getattr(torch, dtype)
    assert not head.embed_tokens.weight.requires_grad and not head.lm_head.weight.requires_grad
    assert head.config.num_hidden_layers == 4 and head.config.vocab_size == 128


def test_tied_and_sharded_targets_are_read_without_building_them(tmp_path, make_target):
    tied_path = make_target("tied", tie_word_embeddings=True)
    tied_target = load_target(tied_path)
    from transformers import AutoModelForCausalLM

    sharded_path = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(make_target("big"))
    model.save_pretrained(sharded_path, max_shard_size="20KB")
    assert (sharded_path / "model.safetensors.index.json").is_file()
    sharded_target = load_target(sharded_path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.PreTrainedModel, "__init__", _refuse)
        tied = load_target_head(tied_path)
        sharded = load_target_head(sharded_path)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert torch.equal(tied.lm_head.weight, tied_target.get_output_embeddings().weight)
    assert torch.equal(sharded.embed_tokens.weight, sharded_target.get_input_embeddings().weight)
    assert torch.equal(sharded.lm_head.weight, sharded_target.get_output_embeddings().weight)


def test_a_drafter_on_the_head_alone_is_the_drafter_on_the_whole_target(tiny_target, tiny_config, tmp_path):
    cfg = config_from_dict(tiny_config(tmp_path))
    torch.manual_seed(0)
    on_target = build_drafter(cfg, TargetHead.of(load_target(tiny_target)))
    head = load_target_head(tiny_target)
    torch.manual_seed(0)
    on_head = build_drafter(cfg, head)
    assert on_head.cfg == on_target.cfg
    for (name, ours), (_, theirs) in zip(on_head.state_dict().items(), on_target.state_dict().items(),
                                         strict=True):
        assert torch.equal(ours, theirs), name
    # Frozen: the embedding and lm_head only (vocab 128 x hidden 32 each), no decoder layer.
    assert sum(p.numel() for p in on_head.parameters() if not p.requires_grad) == 2 * 128 * 32


def _refuse(*args, **kwargs):
    raise AssertionError("the target model was built")


def test_a_weights_file_that_cannot_be_opened_is_reported_with_its_own_error(tmp_path, make_target):
    """safetensors says "No such file or directory" for any file it cannot open (a permission denied to the
    run's user among them) and "No such device" for a directory; the loaders open each file first, so the
    error is the system's own, with the path."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(make_target("big")).save_pretrained(path, max_shard_size="20KB")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = path / next(file for name, file in weight_map.items() if name.endswith("embed_tokens.weight"))
    shard.unlink()
    shard.mkdir()  # a name that is there but does not open as a file
    for load in (load_target, load_target_head):
        with pytest.raises(IsADirectoryError, match=str(shard)):
            load(path)
