"""The simulation's own documented commands (inventory/sim/README.md), run as written in a fresh copy of the
checkout: `python -m pvesim up` (what `make sim-up` runs), then the README's block line by line, with no
variable the README does not show (no DFLASH_SIM_ASSETS). The whole run builds the demo's default assets
(minutes on 2 cores): it runs under make test-reliability; make test checks where the simulation's
group_vars look for those assets without DFLASH_SIM_ASSETS (the checkout's .demo/assets, whichever
playbook runs). And the README's opening says the recipe's split."""

import os
import re
import shlex
import shutil
import subprocess

import pytest
import yaml

from pvesim.fleet import REPO, VENV_BIN

SIM_README = REPO / "inventory" / "sim" / "README.md"


def documented_commands():
    """The README's indented command block, each line as argv (comments dropped)."""
    lines = [line[4:] for line in SIM_README.read_text().splitlines() if line.startswith("    ")]
    return [argv for argv in (shlex.split(line, comments=True) for line in lines) if argv]


def checkout_copy(dest):
    """The checkout's files (tracked, and new ones not ignored) copied to `dest`, with the venv."""
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], capture_output=True, check=True)
    for name in tracked.stdout.decode().split("\0"):
        if name and (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    (dest / ".venv").symlink_to(REPO / ".venv")
    return dest


def clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "ANSIBLE_", "PYTHONPATH"))}
    env["PATH"] = f"{VENV_BIN}:{env['PATH']}"
    return env


def test_the_simulation_s_assets_are_the_checkout_s_demo_assets_without_a_variable(tmp_path):
    checkout = checkout_copy(tmp_path / "dflash-ops")
    (checkout / "inventory" / "sim" / "hosts.yml").write_text(
        "all:\n  children:\n    training_containers:\n      hosts:\n        ct200:\n"
        "          ansible_connection: local\n")
    debug = ["ansible", "ct200", "-m", "ansible.builtin.debug", "-a", "var=dflash_release_target_path"]
    res = subprocess.run(debug, cwd=checkout, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f'"dflash_release_target_path": "{checkout}/.demo/assets/target"' in res.stdout, res.stdout


@pytest.mark.sim
@pytest.mark.slow
@pytest.mark.reliability_full
def test_the_simulation_readme_runs_as_written(tmp_path):
    commands = documented_commands()
    assert [argv[:2] for argv in commands] == [["python", "-m"], ["ansible-playbook", "playbooks/deploy.yml"],
                                               ["ansible-playbook", "playbooks/status.yml"]]
    checkout = checkout_copy(tmp_path / "dflash-ops")
    env = clean_env()
    up = subprocess.run([str(VENV_BIN / "python"), "-m", "pvesim", "up"], cwd=checkout, env=env,
                        capture_output=True, text=True, timeout=600)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        for argv in commands:
            res = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True, timeout=1800,
                                 stdin=subprocess.DEVNULL)
            assert res.returncode == 0, f"{shlex.join(argv)}:\n{res.stdout[-4000:]}{res.stderr[-2000:]}"
        assert re.search(r"ct200 .*running", res.stdout), res.stdout[-3000:]
    finally:
        subprocess.run([str(VENV_BIN / "python"), "-m", "pvesim", "down"], cwd=checkout, env=env,
                       capture_output=True, timeout=300)


def test_the_readme_opening_names_the_recipe_s_split():
    pipeline = yaml.safe_load((REPO / "configs" / "qwen3-8b.yaml").read_text())["pipeline"]
    target, drafter = len(pipeline["target_gpus"]), len(pipeline["drafter_gpus"])
    opening = (REPO / "README.md").read_text().split("\n\n")[1]
    assert f"{target} GPUs run the frozen target model" in opening, opening
    assert f"{drafter} train the drafter" in " ".join(opening.split()), opening
