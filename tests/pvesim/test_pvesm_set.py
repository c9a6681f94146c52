"""`pvesm set <storage> --content` as pve-storage has it (the list given replaces the storage's whole
content), `pvesh get /storage/<storage>`, and the README's line that adds `snippets` to `local`, run on a
node's shell as written: it keeps what the storage held."""

import json

import pytest

from tests.roles.readme_commands import readme_inline

pytestmark = pytest.mark.sim


@pytest.fixture(scope="module")
def lone(tmp_path_factory):
    import pvesim
    s = pvesim.up(nodes=1, containers=(300,), gpus=0, state_dir=tmp_path_factory.mktemp("pvesm") / "state",
                  inventory=tmp_path_factory.mktemp("pvesm-inv") / "hosts.yml")
    yield s
    pvesim.down(s.state_dir)


def content(sim, storage):
    res = sim.ssh("pve1", f"pvesh get /storage/{storage} --output-format json")
    assert res.returncode == 0, res.stderr
    return set(json.loads(res.stdout)["content"].split(","))


def test_set_content_replaces_the_whole_list_and_leaves_out_what_the_storage_cannot_hold(lone):
    assert content(lone, "local") == {"backup", "iso", "vztmpl"}
    res = lone.ssh("pve1", "pvesm set local-lvm --content rootdir,images,iso")
    assert res.returncode == 0 and res.stderr == "storage does not support content type 'iso'\n"
    assert content(lone, "local-lvm") == {"images", "rootdir"}
    assert lone.ssh("pve1", "pvesm set local --content snippets").returncode == 0
    assert content(lone, "local") == {"snippets"}  # pve-storage's update: what was there is gone
    assert lone.ssh("pve1", "pvesm set local --content backup,iso,vztmpl").returncode == 0


def test_the_readme_s_line_adds_snippets_and_keeps_what_local_holds(lone):
    # A node whose `local` holds more than a fresh install's (its admin added container disks to it).
    assert lone.ssh("pve1", "pvesm set local --content backup,iso,vztmpl,rootdir,images").returncode == 0
    res = lone.ssh("pve1", readme_inline("pvesm", "set", "local"))
    assert res.returncode == 0, res.stderr
    assert content(lone, "local") == {"backup", "iso", "vztmpl", "rootdir", "images", "snippets"}
    status = lone.ssh("pve1", "pvesm status --content snippets").stdout.split()
    assert "local" in status
