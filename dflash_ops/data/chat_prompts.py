"""The prompts of a regeneration: the chats of a prompt file, the target's tokenizer and chat template, the
length bound of an answer, and the rows files (an output and its parts) they end in. Shared by the
in-process path (`dflash_ops.data.regenerate`) and the engines' (`dflash_ops.data.regenerate_engine`)."""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass
from pathlib import Path

from dflash_ops.data.chat_formats import PromptError, read_chat_rows  # noqa: F401 (PromptError: this module's API)


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int | None = None  # None: up to the length bound (max_length less the prompt)
    batch_size: int = 8
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.max_new_tokens is not None and self.max_new_tokens < 1) or self.batch_size < 1:
            raise ValueError("max_new_tokens and batch_size must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], "
                             f"got {self.temperature} and {self.top_p}")


def read_chats(path: str | Path) -> list[list[dict]]:
    """The chat of each row of the prompt set at `path` (`dflash_ops.data.chat_formats`: JSON lines of
    messages or ShareGPT/SpecForge conversations, parquet, Arrow; blank lines count, as empty chats, so ids
    stay line indices), without a trailing assistant message."""
    chats = []
    for messages in read_chat_rows(path):
        if messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        chats.append(messages or [])
    return chats


def load_tokenizer(target_path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_path, local_files_only=True)
    if not tokenizer.chat_template:
        raise PromptError(f"the tokenizer at {target_path} has no chat template")
    return tokenizer


class PendingPrompts:
    """The chats of the given indices as prompts (chat template, generation prompt, the mode as its
    enable_thinking where `mode` is not None), one at a time; an empty line is passed over and a prompt
    of `max_length` tokens or more is skipped and counted in `too_long` (it leaves no room to answer)."""

    def __init__(self, tokenizer, chats: list[list[dict]], mode: bool | None, max_length: int):
        self.tokenizer, self.chats, self.max_length, self.too_long = tokenizer, chats, max_length, 0
        self.options = {} if mode is None else {"enable_thinking": mode}

    def prompts(self, indices):
        for index in indices:
            if not self.chats[index]:
                continue
            prompt = list(self.tokenizer.apply_chat_template(self.chats[index], add_generation_prompt=True,
                                                             tokenize=True, return_dict=True,
                                                             **self.options)["input_ids"])
            if len(prompt) >= self.max_length:
                self.too_long += 1
                continue
            yield index, prompt


def answer_bound(settings: GenerationSettings, max_length: int, prompt_length: int) -> int:
    """The most tokens an answer to a prompt of `prompt_length` may have: the room `max_length` leaves it,
    and at most settings.max_new_tokens where that is set."""
    room = max_length - prompt_length
    return room if settings.max_new_tokens is None else min(settings.max_new_tokens, room)


def complete_rows(path: Path):
    """The complete rows of an output or part file, in file order; a line cut short is skipped."""
    if not path.is_file():
        return
    with path.open() as lines:
        for line in lines:
            try:
                row = json.loads(line)
                int(row["id"])
            except (ValueError, KeyError, TypeError):
                continue
            yield row


def read_rows(path: Path) -> dict[int, dict]:
    """Complete rows of an output or part file by id; a last line cut short is dropped."""
    return {int(row["id"]): row for row in complete_rows(path)}


def part_path(out: Path, replica: int) -> Path:
    return out.with_name(f"{out.name}.part-{replica}")


def parts(out: Path) -> list[Path]:
    """Every part file of `out`, of any replica count."""
    return sorted(out.parent.glob(f"{glob.escape(out.name)}.part-*"))
