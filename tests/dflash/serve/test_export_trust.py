"""An export another user wrote is never taken for the release's: `--into` refuses a directory of another
user's (a run as dflash_run_user owns its output directory), an export whose SHA256SUMS matches but whose
code is not this package's is written again rather than kept, and the collection's side (which runs on
the controller without this package) names the same code files and auto_map. Also the controller's
curves: `python -m dflash_ops.plots --out DIR` replaces a link planted at loss.png, never writes through
it, and refuses a DIR of another user's."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from dflash_ops.core.safe_paths import UnsafePath
from dflash_ops.serve import export as export_module
from dflash_ops.serve.export import AUTO_MAP, CODE_FILES, MANIFEST, export_checksums, run_export
from dflash_ops.training import plots

NOBODY = 65534
REPO = Path(__file__).resolve().parents[3]
MARKER = "import os; os.system('id > /tmp/dflash-export-ran')\n"


def planted_export(directory: Path, modeling: str) -> Path:
    """An export at `directory` whose SHA256SUMS matches its files, `modeling` its modeling_dflash.py."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"dtype": "bfloat16", "auto_map": AUTO_MAP}))
    (directory / "model.safetensors").write_bytes(b"weights")
    (directory / "README.md").write_text("readme\n")
    (directory / "modeling_dflash.py").write_text(modeling)
    drafter = next(source for source in CODE_FILES if source.name == "drafter.py")
    (directory / "drafter.py").write_text(drafter.read_text())
    names = ["config.json", "model.safetensors", "modeling_dflash.py", "drafter.py", "README.md"]
    (directory / MANIFEST).write_text("".join(
        f"{hashlib.sha256((directory / name).read_bytes()).hexdigest()}  {name}\n" for name in names))
    return directory


def test_an_export_whose_code_is_not_the_releases_is_not_kept(tmp_path):
    modeling = next(source for source in CODE_FILES if source.name == "modeling_dflash.py")
    own = planted_export(tmp_path / "own", modeling.read_text())
    assert export_checksums(own, "bfloat16") is not None  # the release's own code: kept
    planted = planted_export(tmp_path / "planted", modeling.read_text() + MARKER)
    assert export_checksums(planted, "bfloat16") is None  # its SHA256SUMS matches, its code is not ours


def test_into_a_directory_of_another_users_is_refused_before_anything_is_read(tmp_path):
    into = tmp_path / "exports"
    planted = planted_export(into / "step-00000010", "planted\n")
    os.chown(into, NOBODY, NOBODY)
    with pytest.raises(UnsafePath, match=f"owned by uid {NOBODY}"):
        run_export(tmp_path / "run", 10, None, into, "bfloat16", plan=False)
    assert (planted / "modeling_dflash.py").read_text() == "planted\n"


def test_the_collection_names_the_code_and_the_files_an_export_has():
    from ansible_collections.dflash.ops.plugins.module_utils import export_files

    assert export_files.AUTO_MAP == AUTO_MAP
    package = Path(export_module.__file__).resolve().parents[1]
    assert {name: package.parent / path for name, path in export_files.CODE_FILES.items()} == \
        {source.name: source.resolve() for source in CODE_FILES}
    assert export_files.EXPORT_FILES == {"config.json", "model.safetensors", "README.md", MANIFEST,
                                         *(source.name for source in CODE_FILES)}


CURVES = {"ct200": {"train": {1: {"kind": "train", "step": 1, "loss": 2.0}, 2: {"loss": 1.5}}}}


def test_a_link_planted_at_a_figure_is_replaced_not_written_through(tmp_path):
    victim = tmp_path / "root-file"
    victim.write_text("root's own\n")
    victim.chmod(0o600)
    out = tmp_path / "metrics"
    out.mkdir(mode=0o700)
    (out / "loss.png").symlink_to(victim)
    written = plots.plot_runs(CURVES, out)
    assert victim.read_text() == "root's own\n"
    for path in written:
        assert not path.is_symlink() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert sorted(p.name for p in out.iterdir()) == ["loss.png", "tau.png"]  # no temporary file left


def test_a_figure_directory_of_another_users_is_refused(tmp_path, capsys):
    out = tmp_path / "metrics"
    out.mkdir()
    os.chown(out, NOBODY, NOBODY)
    metrics = tmp_path / "ct200.metrics.jsonl"
    metrics.write_text(json.dumps({"kind": "train", "step": 1, "loss": 2.0}) + "\n")
    assert plots.main([str(metrics), "--out", str(out)]) == 2
    assert f"owned by uid {NOBODY}" in capsys.readouterr().err
    assert list(out.iterdir()) == []
