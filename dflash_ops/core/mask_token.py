"""The mask token that fills a drafter's blocks: an id that cannot stop generation.

Serving code pre-fills each block with the mask id and stops when a stop token appears in the
output, so a mask id equal to a stop id (Qwen3's pad token <|endoftext|> is one) ends generation
after the first block. The default is a reserved embedding row: the first row past the tokenizer's
vocabulary when the embedding has spare rows (Qwen3: 151669 of 151936 rows, as the public DFlash
checkpoints use); else the tokenizer's own mask token; a target saved without a tokenizer gets its
last embedding row.

The checks read only the target's JSON files (config.json, generation_config.json), so that
`python -m dflash_ops.config validate` stays light; finding the default loads the tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

KEY = "model.mask_token_id"


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def stop_token_ids(target_path: str | Path) -> dict[int, str]:
    """Token id -> where the target names it as a stop or pad token: config.json's (or its
    text_config's) eos_token_id and pad_token_id, generation_config.json's eos_token_id (an id or
    a list) and pad_token_id."""
    path = Path(target_path)
    config = _read_json(path / "config.json")
    found: dict[int, str] = {}
    for source, values in (("config.json", config.get("text_config") or config),
                           ("generation_config.json", _read_json(path / "generation_config.json"))):
        for key in ("eos_token_id", "pad_token_id"):
            for token_id in _ids(values.get(key)):
                found.setdefault(token_id, f"{source} {key}")
    return found


def mask_token_problem(mask_token_id: int, target_path: str | Path, vocab_size: int) -> str | None:
    """Why `mask_token_id` cannot be the mask token of a drafter for the target at `target_path`
    (with `vocab_size` embedding rows), with the fix; None when it can."""
    fix = (f"set {KEY} to a reserved embedding row that no text uses (e.g. the first row past the "
           "tokenizer's vocabulary), or to null for that default")
    if not 0 <= mask_token_id < vocab_size:
        return f"{mask_token_id} is outside the target's embedding (ids 0..{vocab_size - 1}): {fix}"
    stops = stop_token_ids(target_path)
    if mask_token_id in stops:
        return (f"{mask_token_id} is the target's {stops[mask_token_id]}: a block pre-filled with it "
                f"stops generation; {fix}")
    return None


def _tokenizer_facts(target_path: Path) -> tuple[int, int | None, set[int]] | None:
    """(tokens the tokenizer knows, its mask token id, its eos and pad ids), None without a tokenizer."""
    if not ((target_path / "tokenizer.json").is_file() or (target_path / "tokenizer_config.json").is_file()):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_path), local_files_only=True)
    specials = {t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None}
    return len(tokenizer), tokenizer.mask_token_id, specials


def default_mask_token_id(target_path: str | Path, vocab_size: int) -> int:
    """The first embedding row past the tokenizer's vocabulary, else the tokenizer's mask token
    (when it is no stop token), else (no tokenizer) the last row; ValueError when none fits."""
    path = Path(target_path)
    facts = _tokenizer_facts(path)
    stops = set(stop_token_ids(path))
    if facts is None:
        candidates = [vocab_size - 1]
    else:
        n_tokens, tokenizer_mask, specials = facts
        stops |= specials
        candidates = [n_tokens] if n_tokens < vocab_size else []
        candidates += [tokenizer_mask] if tokenizer_mask is not None else []
    for token_id in candidates:
        if 0 <= token_id < vocab_size and token_id not in stops:
            return int(token_id)
    raise ValueError(f"{KEY}: the target at {path} has no spare embedding row (its tokenizer uses all "
                     f"{vocab_size}) and no mask token that is not a stop token; set {KEY} to the id of "
                     "a token that never stops generation")


def resolve_mask_token_id(configured: int | None, target_path: str | Path, vocab_size: int) -> int:
    """The configured mask token (checked by `mask_token_problem`), else `default_mask_token_id`."""
    if configured is None:
        return default_mask_token_id(target_path, vocab_size)
    problem = mask_token_problem(configured, target_path, vocab_size)
    if problem is not None:
        raise ValueError(f"{KEY}: {problem}")
    return configured
