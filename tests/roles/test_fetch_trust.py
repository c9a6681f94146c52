"""What the controller takes from a container is root's or checked, never a link (pvesim, one container
whose run runs as dflash_run_user, as docs/SECURITY.md's "What the controller takes" says):

- export.yml works with dflash_run_user, writes the export as root in a directory of root's alone
  (/var/lib/dflash/exports/<run>, 0700), and an export the run's user planted in its own output directory
  (a modeling_dflash.py that runs its code where the export is loaded, with a SHA256SUMS to match) reaches
  the controller neither by default nor when the container directory named is that one;
- fetch_metrics.yml brings the TensorBoard event files beside metrics.jsonl (TensorBoard's own reader
  reads them), all 0600 in directories 0700;
- a link to /etc/shadow that the run's user put at metrics.jsonl or among the event files, and a controller
  directory of another user's (`nobody`), copy nothing."""

from __future__ import annotations

import json
import os
import shlex
import stat
from pathlib import Path

import pytest

from pvesim.fleet import Fleet
from tests.run_user import readable_assets, site_packages_for_run_user
from tests.waiting import wait_for

pytestmark = [pytest.mark.sim, pytest.mark.slow]

VMID, HOST = 200, "ct200"
OUTPUT = "/var/lib/dflash/runs/main"
EXPORTS = "/var/lib/dflash/exports/main"
MARKER = "planted-by-the-runs-user"
EXPORT_TASK = "Ensure the run's checkpoint is exported and on the controller, each file checked."
FETCH_TASK = "Ensure the run's metrics and TensorBoard events are on the controller, no link followed."
NOBODY = 65534
AUTO_MAP = '{"AutoModel": "modeling_dflash.DFlashDraftModel"}'


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with site_packages_for_run_user() as site_packages:
        f = Fleet(tmp_path_factory.mktemp("fetch-trust-fleet"), nodes=1, containers=(VMID,))
        try:
            # As tests/roles/test_secrets_and_trust.py: the machine's python (under /root), the venv's
            # site-packages and the sim's assets where the run's user may read them, whatever the checkout.
            assert f.ct(VMID, "chmod 0711 /root").returncode == 0
            f.host_vars(HOST, {"dflash_run_user": "dflash", "dflash_sim_assets": readable_assets(f, VMID),
                               "dflash_env_site_packages": [site_packages]})
            res = f.play("deploy.yml")
            assert res.rc == 0, res
            yield f
        finally:
            f.down()


def as_user(fleet, command):
    """`command` run by the run's user in the container."""
    return fleet.ct(VMID, "setpriv --reuid \"$(id -u dflash)\" --regid \"$(id -g dflash)\" --init-groups "
                          f"sh -c {shlex.quote(command)}")


def modes(directory):
    """{path under `directory`: mode} of everything under it, itself included as '.'."""
    found = {".": stat.S_IMODE(os.lstat(directory).st_mode)}
    for path in Path(directory).rglob("*"):
        found[str(path.relative_to(directory))] = stat.S_IMODE(os.lstat(path).st_mode)
    return found


def holds(directory, text):
    """The files under `directory` whose bytes contain `text`."""
    return [str(p) for p in Path(directory).rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


def plant_export(fleet, step):
    """As the run's user, an export of `step` in its own output directory (the exports' old place): the
    checkpoint's weights, the release's code with a line that writes a file where it is loaded, and a
    SHA256SUMS that matches."""
    release = fleet.live_release(VMID)
    planted = f"{OUTPUT}/exports/step-{step:08d}"
    script = f"""set -e
mkdir -p {planted} && cd {planted}
cp {OUTPUT}/checkpoints/step-{step:08d}/model.safetensors model.safetensors
cp {release}/dflash_ops/model/drafter.py drafter.py
cp {release}/dflash_ops/model/modeling_dflash.py modeling_dflash.py
echo "open('/tmp/{MARKER}', 'w').write('{MARKER}')" >> modeling_dflash.py
printf '%s\\n' '{{"dtype": "bfloat16", "auto_map": {AUTO_MAP}}}' > config.json
echo '# {MARKER}' > README.md
sha256sum config.json model.safetensors modeling_dflash.py drafter.py README.md > SHA256SUMS
"""
    made = as_user(fleet, script)
    assert made.returncode == 0, made.stderr
    return planted


def wait_for_events(fleet):
    found = wait_for(lambda: fleet.status(VMID).get("heldout_tau") is not None and fleet.ct(
        VMID, f"ls {OUTPUT}/tensorboard | grep -q tfevents").returncode == 0, timeout=180, interval=1)
    assert found, fleet.status(VMID)


def test_fetch_metrics_brings_the_tensorboard_events_beside_the_metrics_privately(fleet, tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    wait_for_events(fleet)
    dest = tmp_path / "metrics"
    res = fleet.play("fetch_metrics.yml", "-e", f"dflash_metrics_dir={dest}")
    assert res.rc == 0, res
    fetched = res.results(FETCH_TASK)[HOST]["fetched"]
    assert "ct200.metrics.jsonl" in fetched
    assert any(path.startswith("ct200/events.out.tfevents.") for path in fetched), fetched
    # What `tensorboard --logdir <dest>` reads: the run's scalars, at the steps metrics.jsonl has.
    events = event_accumulator.EventAccumulator(str(dest / HOST))
    events.Reload()
    assert "train/loss" in events.Tags()["scalars"], events.Tags()
    steps = {record.step for record in events.Scalars("train/loss")}
    records = [json.loads(line) for line in (dest / "ct200.metrics.jsonl").read_text().splitlines()]
    assert steps and steps <= {record["step"] for record in records if record["kind"] == "train"}
    assert (dest / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(modes(dest).values()) <= {0o700, 0o600}, modes(dest)
    # Again, into the directory the play made: it is the controller user's own, 0700.
    again = fleet.play("fetch_metrics.yml", "-e", f"dflash_metrics_dir={dest}")
    assert again.rc == 0, again


def test_an_export_the_runs_user_planted_never_reaches_the_controller(fleet, tmp_path):
    stopped = fleet.play("stop_training.yml")  # its checkpoints stay as they are (a run keeps its latest 2)
    assert stopped.rc == 0, stopped
    step = int(fleet.ct(VMID, f"ls {OUTPUT}/checkpoints | grep '^step-' | tail -1").stdout.strip()[5:])
    plant_export(fleet, step)
    res = fleet.play("export.yml", "-e", f"dflash_run_export_dir={tmp_path}",
                     "-e", f"dflash_run_export_step={step}")
    assert holds(tmp_path, MARKER) == []  # nothing of the user's export
    assert res.rc == 0, res  # with dflash_run_user (it failed: "... owned by uid 994")
    result = res.results(EXPORT_TASK)[HOST]
    dest = tmp_path / HOST / f"step-{step:08d}"
    assert result["dir"] == f"{EXPORTS}/step-{step:08d}" and result["dest"] == str(dest)
    # Root's code, the release's own; private on the controller.
    release_code = fleet.src / "dflash_ops/model/modeling_dflash.py"
    assert (dest / "modeling_dflash.py").read_bytes() == release_code.read_bytes()
    assert set(modes(tmp_path / HOST).values()) <= {0o700, 0o600}, modes(tmp_path / HOST)
    assert fleet.ct(VMID, f"stat -c '%U %a' /var/lib/dflash/exports {EXPORTS}").stdout.split() == \
        ["root", "700", "root", "700"]
    assert as_user(fleet, f"touch {EXPORTS}/step-{step:08d}/evil").returncode != 0

    # Named as the container's export directory, the user's own directory is refused before it is read.
    elsewhere = tmp_path / "named"
    res = fleet.play("export.yml", "-e", f"dflash_run_export_dir={elsewhere}",
                     "-e", f"dflash_run_export_step={step}",
                     "-e", f"dflash_run_export_container_dir={OUTPUT}/exports")
    assert res.rc != 0
    assert f"into {OUTPUT}/exports" in res.messages() and "is owned by uid" in res.messages(), res.messages()
    assert not elsewhere.exists() or holds(elsewhere, MARKER) == []
    assert fleet.ct(VMID, f"test -e /tmp/{MARKER}").returncode != 0


def test_links_and_another_users_directory_copy_nothing(fleet, tmp_path):
    wait_for_events(fleet)
    stopped = fleet.play("stop_training.yml")  # the run's own writes stay out of the way of the plants
    assert stopped.rc == 0, stopped
    shadow = fleet.read(VMID, "/etc/shadow").splitlines()[0]
    for number, plant in enumerate((f"mv {OUTPUT}/metrics.jsonl {OUTPUT}/kept.jsonl && "
                                    f"ln -s /etc/shadow {OUTPUT}/metrics.jsonl",
                  f"mv {OUTPUT}/kept.jsonl {OUTPUT}/metrics.jsonl && "
                  f"ln -s /etc/shadow {OUTPUT}/tensorboard/events.out.tfevents.1.planted")):
        assert as_user(fleet, plant).returncode == 0
        dest = tmp_path / f"metrics-{number}"
        res = fleet.play("fetch_metrics.yml", "-e", f"dflash_metrics_dir={dest}")
        assert holds(dest, shadow) == [] and not (dest / "ct200.metrics.jsonl").exists()
        assert res.rc != 0
        assert "is a symbolic link (to /etc/shadow)" in res.messages(), res.messages()
    as_user(fleet, f"rm {OUTPUT}/tensorboard/events.out.tfevents.1.planted")

    # A controller directory that another local user made (as in /tmp) is refused: nothing lands in it.
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    res = fleet.play("fetch_metrics.yml", "-e", f"dflash_metrics_dir={theirs}")
    assert res.rc != 0 and f"is owned by uid {NOBODY}" in res.messages(), res.messages()
    assert list(theirs.iterdir()) == []
