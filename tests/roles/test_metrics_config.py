"""dflash_run_metrics_textfile puts the run's Prometheus keys in the release's config (the textfile directory
and the labels: container, node, run), and off leaves the config as it was: the dflash_release role's
template rendered as tests/roles/test_recipe_inventory.py renders it, from inventory/production.example."""

import pytest
import yaml

from pvesim.fleet import run_playbook
from tests.roles.test_recipe_inventory import EXAMPLE, RENDER


def rendered_run(tmp_path, **extravars):
    playbook = tmp_path / "render.yml"
    playbook.write_text(RENDER)
    rendered = tmp_path / "config.yaml"
    result = run_playbook(playbook, EXAMPLE, extravars={"rendered": str(rendered), **extravars})
    assert result.rc == 0, result.stdout[-3000:]
    return yaml.safe_load(rendered.read_text())["run"]


@pytest.mark.slow
def test_metrics_on_put_the_textfile_and_the_labels_in_the_config_and_off_nothing(tmp_path):
    off = rendered_run(tmp_path)
    assert not {"metrics_textfile_dir", "metrics_labels"} & set(off), off
    on = rendered_run(tmp_path, dflash_run_metrics_textfile=True, dflash_run_metrics_textfile_dir="/srv/prom")
    assert on["metrics_textfile_dir"] == "/srv/prom"
    assert on["metrics_labels"] == {"container": "ct200", "node": "pve1", "run": "main"}
    assert {k: v for k, v in on.items() if not k.startswith("metrics_")} == off
