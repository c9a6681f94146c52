"""The manifest of regenerated data, and the check that a run trains in the thinking mode its data
was generated in.

`python -m dflash_ops.data regenerate --out TRAIN.jsonl` (`dflash_ops.data.regenerate`) writes
`TRAIN.jsonl.manifest.json` beside its output once every row is there: format `dflash-regenerated/1`,
`target` and `prompts` (the paths it read), `enable_thinking` (what the target's chat template was
given, true or false; null when the template has no such toggle), `template_takes_thinking`,
`generation` (the settings the answers were generated with) and `rows`. While a regeneration is
unfinished the same record, without `rows`, is `TRAIN.jsonl.parts.json`.

A run is refused (`ConfigError` on `data.enable_thinking`) when its `data.path` or `data.eval_path`
has a manifest whose `enable_thinking` is not null and differs from the config's: a drafter trained
on one mode's answers and served in the other accepts far fewer tokens than its training accuracy
says. Data without a manifest (a user's own) is not checked; checkpoints and exports then say that the
mode is the config's word alone (`enable_thinking_confirmed: false`). `python -m dflash_ops.config validate`,
the training start (`dflash_ops.run.main`) and each drafter's run (for its checkpoints' meta) call
`check_thinking_mode`; this module imports no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_ops.core.config import ConfigError, TrainConfig

FORMAT = "dflash-regenerated/1"
KEY = "data.enable_thinking"


def manifest_path(data_path: str | Path) -> Path:
    """`<data>.manifest.json`: the manifest of a regenerated data file."""
    path = Path(data_path)
    return path.with_name(f"{path.name}.manifest.json")


def mode_name(mode: bool | None) -> str:
    """A thinking mode as YAML and the command line write it."""
    return "null" if mode is None else json.dumps(mode)


def read_record(path: Path) -> dict | None:
    """The manifest (or unfinished regeneration's record) at `path`; None when there is no file;
    ValueError when the file is not one."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a {FORMAT} record: {exc}") from exc
    if not (isinstance(record, dict) and record.get("format") == FORMAT
            and record.get("enable_thinking", "absent") in (True, False, None)):
        raise ValueError(f"{path} is not a {FORMAT} record (format and enable_thinking: true, false or null)")
    return record


def check_thinking_mode(cfg: TrainConfig) -> bool:
    """The config's thinking mode is its regenerated data's: ConfigError naming data.enable_thinking,
    the data's mode and the config's otherwise. Returns whether a manifest confirmed it (False: no data
    file's manifest names a mode, so the config's value is the user's word alone)."""
    confirmed = False
    for key in ("path", "eval_path"):
        data = getattr(cfg.data, key)
        if data is None:
            continue
        manifest = manifest_path(data)
        try:
            record = read_record(manifest)
        except ValueError as exc:
            raise ConfigError(f"data.{key}", f"{exc}; regenerate the data or remove the manifest") from exc
        mode = None if record is None else record["enable_thinking"]
        if mode is not None and mode != cfg.data.enable_thinking:
            theirs, ours = mode_name(mode), mode_name(cfg.data.enable_thinking)
            raise ConfigError(KEY, f"the config says {ours}, but data.{key} {data} was regenerated with "
                              f"enable_thinking {theirs} (its manifest {manifest}): a drafter trained in one "
                              "thinking mode and served in the other accepts far fewer tokens; set "
                              f"data.enable_thinking: {theirs}, or regenerate the data with "
                              f"--enable-thinking {ours}")
        confirmed = confirmed or mode is not None
    return confirmed
