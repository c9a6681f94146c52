"""torch.compile's cache is kept in the run's output directory, which outlives restarts and releases
(dflash_ops.core.compile_cache): the launcher's torchrun (and so every worker) and the single process get
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR there, unless the user set them."""

from __future__ import annotations

import os
import signal
import stat

import pytest

from dflash_ops.core.compile_cache import CACHE_VARIABLES
from dflash_ops.core.config import PipelineConfig, load_config
from dflash_ops.run import launcher
from dflash_ops.run.launcher import Launcher, plan_workers, torchrun_environment


@pytest.fixture
def no_cache_variables(monkeypatch):
    """Neither variable set; whatever a test sets in os.environ is undone after it."""
    for name in CACHE_VARIABLES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


class Launched(Exception):
    """torchrun's Popen, stopped before anything starts; it carries the environment it was given."""


def test_the_launched_workers_compile_into_the_runs_output_dir(write_config, tmp_path, monkeypatch,
                                                                no_cache_variables):
    def popen(command, env, **kwargs):
        raise Launched(env)

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    config = write_config("run", pipeline={"target_workers": 1, "drafter_workers": 1})
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(Launched) as launched:
            Launcher(load_config(str(config)), str(config)).run()
    finally:  # the launcher's stop handlers, out of this process
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    (env,) = launched.value.args
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "run" / "compile-cache" / "inductor")
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "run" / "compile-cache" / "triton")


def test_a_gpu_layout_makes_the_cache_the_owners_alone_and_a_users_setting_is_kept(tmp_path, monkeypatch,
                                                                                  no_cache_variables):
    monkeypatch.setenv("TRITON_CACHE_DIR", "/srv/triton")
    layout = PipelineConfig(device="cuda", target_gpus=[0], drafter_gpus=[1])
    env = torchrun_environment(plan_workers(layout, 2), layout, ["0", "1"], str(tmp_path / "out"))
    assert env["TRITON_CACHE_DIR"] == "/srv/triton"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "out" / "compile-cache" / "inductor")
    root = tmp_path / "out" / "compile-cache"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and (root / "inductor").is_dir()
    assert not (root / "triton").exists()
    # On CPU nothing compiles: the variables are set, no directory is made.
    cpu = PipelineConfig(target_workers=1, drafter_workers=1)
    env = torchrun_environment(plan_workers(cpu, 0), cpu, [], str(tmp_path / "cpu"))
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cpu" / "compile-cache" / "inductor")
    assert not (tmp_path / "cpu").exists()


def test_a_single_process_compiles_into_the_runs_output_dir(write_config, tmp_path, monkeypatch,
                                                             no_cache_variables):
    from dflash_ops.run.main import run_single_process

    config = load_config(str(write_config("one", optim={"total_steps": 1})))
    assert run_single_process(config) == 0
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "one" / "compile-cache" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "one" / "compile-cache" / "triton")
