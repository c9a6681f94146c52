"""The thinking toggle of regeneration (`--enable-thinking`, `data.enable_thinking`): the chat template
is given the mode, the data's manifest records it, a resume never mixes two modes, a template without
the toggle records null, and a run whose config names the other mode than its data is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflash_ops.config import main as validate_main
from dflash_ops.core.config import ConfigError, config_from_dict
from dflash_ops.data import regenerate as regen
from dflash_ops.data.__main__ import main as data_main
from dflash_ops.data.data_manifest import check_thinking_mode, manifest_path
from dflash_ops.data.regenerate import GenerationSettings, ThinkingModeError, parts_record_path, regenerate
from dflash_ops.run.main import main as train_main
from tests.dflash.conftest import make_tiny_target, write_dataset

SETTINGS = GenerationSettings(max_new_tokens=3, batch_size=2)
EOS = "<|endoftext|>"
SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", EOS]
# Qwen3's generation prompt: enable_thinking false closes an empty think block, anything else leaves
# the thinking to the model.
QWEN3_LIKE = (
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{%- endif %}"
)
NO_TOGGLE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
CHATS = [[{"role": "user", "content": "w1 w2 w3"}],
         [{"role": "user", "content": "w4"}, {"role": "assistant", "content": "w5 w6"}],
         [{"role": "user", "content": "w7 w8"}]]


def save_chat_tokenizer(path: Path, template: str) -> None:
    """A word-level tokenizer (w0..w19, user, assistant, and the chat's special tokens) with `template`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(20)] + ["user", "assistant"] + SPECIALS
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS)
    fast.chat_template = template
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, str]:
    """Two tiny targets: one whose chat template takes enable_thinking, one whose template does not."""
    root = tmp_path_factory.mktemp("thinking-targets")
    found = {}
    for name, template in (("toggle", QWEN3_LIKE), ("plain", NO_TOGGLE)):
        make_tiny_target(root / name)
        save_chat_tokenizer(root / name, template)
        found[name] = str(root / name)
    return found


@pytest.fixture
def prompts(tmp_path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    return str(path)


def rows(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def manifest(out) -> dict:
    return json.loads(manifest_path(out).read_text())


def no_model(*_args, **_kwargs):
    raise AssertionError("a model was loaded before the refusal")


def test_the_template_is_given_the_mode_and_the_manifest_records_it(targets, prompts, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(targets["toggle"])
    think, end_think = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    prompt_of = {}
    for mode in (False, True):
        out = tmp_path / f"thinking-{mode}.jsonl"
        summary = regenerate(targets["toggle"], prompts, str(out), SETTINGS, enable_thinking=mode)
        assert summary["rows"] == 3 and summary["enable_thinking"] is mode
        written = rows(out)
        prompt_of[mode] = [row["input_ids"][: row["loss_mask"].index(1)] for row in written]
        for row, prompt in zip(written, prompt_of[mode], strict=True):
            chat = [m for m in CHATS[row["id"]] if m["role"] != "assistant"]
            expected = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True, enable_thinking=mode)["input_ids"]
            assert prompt == list(expected)
        record = manifest(out)
        assert record["enable_thinking"] is mode and record["template_takes_thinking"] is True
        assert record["target"] == targets["toggle"] and record["prompts"] == prompts and record["rows"] == 3
        assert record["generation"]["max_new_tokens"] == 3 and record["generation"]["temperature"] == 0.0
        assert not parts_record_path(out).exists() and not list(tmp_path.glob(f"{out.name}.part-*"))
    # As the template says: without thinking the prompt closes an empty think block, with it the
    # prompt stops at the assistant's turn.
    for non_thinking, thinking in zip(prompt_of[False], prompt_of[True], strict=True):
        assert non_thinking == thinking + [think, end_think]
        assert think not in thinking


def test_a_resume_in_the_other_mode_is_refused(targets, prompts, tmp_path, monkeypatch, capsys):
    out = tmp_path / "train.jsonl"

    def killed(*_args):
        raise RuntimeError("killed before the merge")

    # A stop after every row was generated: the parts and their record (thinking on) are left.
    with monkeypatch.context() as stopped:
        stopped.setattr(regen, "merge", killed)
        with pytest.raises(RuntimeError, match="killed"):
            regenerate(targets["toggle"], prompts, str(out), SETTINGS, enable_thinking=True)
    part = tmp_path / "train.jsonl.part-0"
    assert len(rows(part)) == 3 and json.loads(parts_record_path(out).read_text())["enable_thinking"] is True
    with monkeypatch.context() as guarded:
        guarded.setattr(regen, "load_target", no_model)
        refusal = ("enable_thinking true, this call's is false; rows of two modes must not mix: resume "
                   "with --enable-thinking true")
        with pytest.raises(ThinkingModeError, match=refusal):
            regenerate(targets["toggle"], prompts, str(out), SETTINGS, enable_thinking=False)
    assert len(rows(part)) == 3 and not out.exists()

    resumed = regenerate(targets["toggle"], prompts, str(out), SETTINGS, enable_thinking=True)
    assert resumed["generated"] == 0 and resumed["rows"] == 3 and manifest(out)["enable_thinking"] is True
    assert not parts_record_path(out).exists()

    # The finished data's manifest is what a later call resumes from: the default (false) is refused.
    before = out.read_text()
    monkeypatch.setattr(regen, "load_target", no_model)
    code = data_main(["regenerate", "--target", targets["toggle"], "--prompts", prompts, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "enable_thinking true, this call's is false" in err and "Traceback" not in err
    assert out.read_text() == before and manifest(out)["enable_thinking"] is True

    # Rows whose mode nothing records are not resumed from either.
    other = tmp_path / "other.jsonl"
    foreign_row = {"id": 0, "input_ids": [1, 2], "loss_mask": [0, 1]}
    (tmp_path / "other.jsonl.part-0").write_text(json.dumps(foreign_row) + "\n")
    with pytest.raises(ThinkingModeError, match="whose thinking mode nothing records"):
        regenerate(targets["toggle"], prompts, str(other), SETTINGS)


def test_a_template_without_the_toggle_records_null_and_refuses_thinking(targets, prompts, tmp_path,
                                                                         monkeypatch, capsys):
    out = tmp_path / "train.jsonl"
    assert regenerate(targets["plain"], prompts, str(out), SETTINGS)["enable_thinking"] is None
    record = manifest(out)
    assert record["enable_thinking"] is None and record["template_takes_thinking"] is False

    refused = tmp_path / "refused.jsonl"
    monkeypatch.setattr(regen, "load_target", no_model)
    code = data_main(["regenerate", "--target", targets["plain"], "--prompts", prompts, "--out", str(refused),
                      "--enable-thinking", "true"])
    err = capsys.readouterr().err
    assert code == 2 and "has no enable_thinking toggle" in err and "Traceback" not in err
    assert not list(tmp_path.glob("refused.jsonl*"))  # nothing written, not even the record

    with pytest.raises(SystemExit):
        data_main(["regenerate", "--help"])
    assert "nothing and the mode recorded is null" in " ".join(capsys.readouterr().out.split())


def train_config(tmp_path: Path, target: Path, data: dict, name: str = "config") -> Path:
    """A config for `target` (its output dir tmp_path/run) with `data` as its data section (block size 2:
    the rows' 3 answer tokens form a block)."""
    raw = {"model": {"target_path": str(target), "block_size": 2}, "data": {"max_length": 48, **data},
           "optim": {"total_steps": 2}, "run": {"output_dir": str(tmp_path / "run")}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_config_in_the_other_mode_than_its_data_is_refused(targets, prompts, tiny_target, tmp_path, capsys):
    thinking = tmp_path / "thinking.jsonl"
    regenerate(targets["toggle"], prompts, str(thinking), SETTINGS, enable_thinking=True)

    config = train_config(tmp_path, tiny_target, {"path": str(thinking)})  # enable_thinking: default false
    assert validate_main(["validate", "--json", str(config)]) == 2
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["key"] == "data.enable_thinking"
    assert "the config says false" in verdict["message"] and "enable_thinking true" in verdict["message"]
    # The training start refuses it too, before anything runs.
    assert train_main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "data.enable_thinking: the config says false" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()

    agrees = train_config(tmp_path, tiny_target, {"path": str(thinking), "enable_thinking": True}, "agrees")
    assert validate_main(["validate", str(agrees)]) == 0

    held_out = train_config(tmp_path, tiny_target, {"path": str(write_dataset(tmp_path / "own.jsonl")),
                                                    "eval_path": str(thinking)}, "held-out")
    assert validate_main(["validate", str(held_out)]) == 2
    assert "data.enable_thinking: the config says false, but data.eval_path" in capsys.readouterr().err


def test_data_without_a_manifest_or_with_a_null_mode_is_not_checked(targets, prompts, tiny_target, tmp_path):
    own = write_dataset(tmp_path / "own.jsonl")  # a user's own data: no manifest
    config = train_config(tmp_path, tiny_target, {"path": str(own), "enable_thinking": True})
    assert validate_main(["validate", str(config)]) == 0
    plain = tmp_path / "plain.jsonl"
    regenerate(targets["plain"], prompts, str(plain), SETTINGS)  # a template without the toggle: null
    model = {"target_path": str(tiny_target)}
    for mode in (False, True):  # either is the config's word alone: nothing confirmed it
        data = {"path": str(plain), "enable_thinking": mode}
        assert check_thinking_mode(config_from_dict({"model": model, "data": data})) is False
    assert check_thinking_mode(config_from_dict({"model": model, "data": {"path": str(own)}})) is False
    toggled = tmp_path / "toggled.jsonl"
    regenerate(targets["toggle"], prompts, str(toggled), SETTINGS)  # non-thinking, said by its manifest
    data = {"path": str(own), "eval_path": str(toggled)}
    assert check_thinking_mode(config_from_dict({"model": model, "data": data})) is True
    assert config_from_dict({"model": model, "data": {"path": str(own)}}).data.enable_thinking is False
    with pytest.raises(ConfigError, match="data.enable_thinking: expected bool, got 'no'"):
        config_from_dict({"model": model, "data": {"path": str(own), "enable_thinking": "no"}})


def test_a_resume_with_other_settings_is_refused_naming_each(targets, prompts, tmp_path, capsys):
    out = tmp_path / "train.jsonl"
    regenerate(targets["toggle"], prompts, str(out), SETTINGS)
    written, recorded = out.read_text(), manifest_path(out).read_text()
    with pytest.raises(regen.ProvenanceError) as refused:
        regenerate(targets["toggle"], prompts, str(out), GenerationSettings(5, temperature=0.7))
    assert "max_new_tokens 3 -> 5" in str(refused.value) and "temperature 0.0 -> 0.7" in str(refused.value)
    other_prompts = tmp_path / "other-prompts.jsonl"
    other_prompts.write_text(Path(prompts).read_text())
    code = data_main(["regenerate", "--target", targets["toggle"], "--prompts", str(other_prompts), "--out",
                      str(out), "--max-new-tokens", "3", "--batch-size", "2", "--dtype", "bfloat16"])
    err = capsys.readouterr().err
    assert code == 2 and f"prompts {prompts!r} -> {str(other_prompts)!r}" in err and "dtype" in err
    assert out.read_text() == written and manifest_path(out).read_text() == recorded, "nothing rewritten"
    # The batch size changes no answer: a resume with another one goes on.
    summary = regenerate(targets["toggle"], prompts, str(out), GenerationSettings(3, batch_size=1))
    assert summary["generated"] == 0
    assert json.loads(manifest_path(out).read_text())["generation"]["batch_size"] == 1
