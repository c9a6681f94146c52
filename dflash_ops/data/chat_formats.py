"""The prompt sets `python -m dflash_ops.data regenerate --prompts` reads, in the formats the field's trainers
bring, each read into one list of `{"role", "content"}` messages per row (`read_chat_rows`):

- JSON lines, each `{"messages": [{"role": ..., "content": ...}, ...]}` or the bare list (OpenAI style);
- JSON lines, each ShareGPT's or SpecForge's `{"conversations": [...]}`, whose turns are
  `{"from": "human"|"gpt"|"system", "value": ...}` (ShareGPT) or `{"role": "user"|"assistant"|"system",
  "content": ...}` (SpecForge), either spelling in any row; `human` reads as `user`, `gpt` as `assistant`;
- a local parquet file, an Arrow file (IPC file or stream, as `datasets` writes its `.arrow` shards), or a
  directory of them (`datasets`' `save_to_disk`, in its `state.json` order, or the `*.parquet`/`*.arrow`
  files under it, sorted), whose rows are either of the above (a `messages` or a `conversations` column);
  read through `pyarrow` when the venv has it (nothing is downloaded; the trainer does not depend on it).

Anything else gets one refusal, naming the row (file:line, or file row N) and the formats above (`ACCEPTED`).
A row's id is its line index (blank lines count) or its row index across the files, in order."""

from __future__ import annotations

import json
from pathlib import Path


class PromptError(ValueError):
    """A prompt line is not a chat."""


ACCEPTED = ("accepted prompt sets: JSON lines (or a local parquet or Arrow file, or a directory of them "
            "as datasets' save_to_disk writes) of chats, each "
            '{"messages": [{"role": ..., "content": ...}, ...]} or the bare list, or ShareGPT/SpecForge '
            '{"conversations": [{"from": "human"|"gpt"|"system", "value": ...} or '
            '{"role": "user"|"assistant"|"system", "content": ...}, ...]}')
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
PARQUET_MAGIC, ARROW_MAGIC = b"PAR1", b"ARROW1"
TABLE_SUFFIXES = (".parquet", ".arrow")


def refusal(where: str, problem: str) -> PromptError:
    """The one refusal of a prompt set this module cannot read: where, what, and the formats it reads."""
    return PromptError(f"{where}: {problem}; {ACCEPTED}")


def _is_message(message) -> bool:
    return (isinstance(message, dict) and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str))


def _turn(turn, where: str) -> dict:
    """One `conversations` turn as a message; either spelling (a table's rows carry both keys, one null)."""
    if not isinstance(turn, dict):
        raise refusal(where, f"a conversations turn is {type(turn).__name__}, not an object")
    role = turn.get("role") if turn.get("role") is not None else turn.get("from")
    content = turn.get("content") if turn.get("content") is not None else turn.get("value")
    if role not in ROLES or not isinstance(content, str):
        raise refusal(where, f"a conversations turn needs from/role in {', '.join(ROLES)} and a string "
                             f"value/content, got {json.dumps(turn)[:200]}")
    return {"role": ROLES[role], "content": content}


def chat_of(row, where: str) -> list[dict]:
    """The messages of one row of any accepted spelling (`PromptError` otherwise)."""
    if isinstance(row, dict) and row.get("conversations") is not None:
        turns = row["conversations"]
        if not isinstance(turns, list) or not turns:
            raise refusal(where, "conversations must be a non-empty list of turns")
        return [_turn(turn, where) for turn in turns]
    messages = row.get("messages") if isinstance(row, dict) else row
    if not (isinstance(messages, list) and messages and all(_is_message(m) for m in messages)):
        raise refusal(where, "not a chat (expected a list of messages with string role and content, or an "
                             "object with one under messages or conversations)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _json_lines(path: Path):
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise refusal(str(path), "not UTF-8 text, nor a parquet or Arrow file") from None
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            yield None
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise refusal(f"{path}:{line_no}", f"not JSON ({exc})") from exc
        yield chat_of(row, f"{path}:{line_no}")


def _pyarrow(path: Path):
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise refusal(str(path), "a parquet or Arrow prompt set is read through pyarrow, which this "
                                 "venv lacks: install it (pip install pyarrow) or write the rows as JSON "
                                 "lines") from None
    import pyarrow.ipc
    import pyarrow.parquet
    return pyarrow


def _table_files(path: Path) -> list[Path]:
    """The parquet and Arrow files of a prompt set: `path` itself, or those of the directory `path`."""
    if path.is_file():
        return [path]
    state = path / "state.json"  # datasets' save_to_disk: its shards, in order
    if state.is_file():
        try:
            return [path / entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise refusal(str(state), f"cannot read its data files ({exc!r})") from exc
    files = sorted(p for p in path.rglob("*") if p.suffix in TABLE_SUFFIXES and p.is_file())
    if not files:
        raise refusal(str(path), "a directory without parquet or Arrow files")
    return files


def _table_rows(path: Path, pa):
    with path.open("rb") as f:
        head = f.read(6)
    try:
        if head[:4] == PARQUET_MAGIC:
            table = pa.parquet.read_table(path)
        elif head == ARROW_MAGIC:
            table = pa.ipc.open_file(path).read_all()
        else:
            with pa.memory_map(str(path)) as source:
                table = pa.ipc.open_stream(source).read_all()
    except (OSError, pa.ArrowException) as exc:
        raise refusal(str(path), f"not a readable parquet or Arrow file ({exc})") from exc
    if "conversations" not in table.column_names and "messages" not in table.column_names:
        columns = ", ".join(table.column_names)
        raise refusal(str(path), f"no conversations or messages column (columns: {columns})")
    for batch in table.to_batches():
        yield from batch.to_pylist()


def read_chat_rows(path: str | Path):
    """The messages of each row of the prompt set at `path` (None for a blank JSON line), in order."""
    path = Path(path)
    if not path.exists():
        raise PromptError(f"{path}: no such file or directory")
    if path.is_file():
        with path.open("rb") as f:
            head = f.read(6)
        if path.suffix not in TABLE_SUFFIXES and head[:4] != PARQUET_MAGIC and head != ARROW_MAGIC:
            yield from _json_lines(path)
            return
    pa = _pyarrow(path)
    index = 0
    for file in _table_files(path):
        for number, row in enumerate(_table_rows(file, pa), start=1):
            index += 1
            yield chat_of(row, f"{file} row {number}")
