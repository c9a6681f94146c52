"""regenerate_data.yml on vLLM, in a pvesim container, as an inventory with `dflash_env_engine: vllm` runs it:
the deploy's env role makes the engine's venv ready (`dflash_env_engine_venv`: here the venv of `make
serve-check`, which the container sees through its overlay; its stamp names the requirements and removals
it was built with, the role's own, so the role leaves it as it is and checks that it imports vllm; the
install from a wheelhouse itself is not run here: a vLLM wheelhouse is ~1 GB), then the playbook starts
the regeneration on that engine from the live release and waits for every row.
Marked `serve` (an engine start): `make regenerate-check`."""

import json
import shlex

import pytest

from benchmarks.serve import KV_CACHE_GIB, SERVE_VENV, serve_venv_problem
from pvesim.fleet import Fleet

pytestmark = [pytest.mark.serve, pytest.mark.sim, pytest.mark.slow]
PROMPTS, OUT = "/root/prompts.jsonl", "/root/vllm-regenerated.jsonl"
WHEELHOUSE = "/srv/empty-wheelhouse"  # the container's own: nothing is downloaded


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    problem = serve_venv_problem()
    if problem:
        pytest.skip(problem)
    f = Fleet(tmp_path_factory.mktemp("vllm-regenerate-fleet"), nodes=1, containers=(200,))
    assert f.ct(200, f"mkdir -p {WHEELHOUSE}").returncode == 0
    # What scripts/serve_venv.py built the venv with, as its stamp says: the role leaves it as it is.
    stamp = (SERVE_VENV / ".complete").read_text().split()
    requirements = [line for line in stamp if not line.startswith("-")]
    removals = [line[1:] for line in stamp if line.startswith("-")]
    engine = ["-e", "dflash_env_engine=vllm", "-e", f"dflash_env_engine_venv={SERVE_VENV}",
              "-e", f"dflash_env_wheelhouse={WHEELHOUSE}",
              "-e", json.dumps({"dflash_env_engine_requirements": requirements,
                                "dflash_env_engine_remove": removals})]
    res = f.play("deploy.yml", "-e", "dflash_fleet_start_run=false", *engine)
    assert res.rc == 0, res.messages()
    f.engine_args = engine
    yield f
    f.down()


def test_the_playbook_regenerates_on_vllm_from_the_engines_venv(fleet):
    lines = (fleet.assets / "data" / "prompts.jsonl").read_text().splitlines()[:8]
    assert fleet.ct(200, f"printf %s {shlex.quote(''.join(line + chr(10) for line in lines))} > {PROMPTS}"
                    ).returncode == 0
    job = {"dflash_regenerate_args": ["--max-new-tokens", "16", "--dtype", "float32"],
           "dflash_regenerate_environment": {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}}
    res = fleet.play("regenerate_data.yml", *fleet.engine_args, "-e", f"dflash_regenerate_prompts={PROMPTS}",
                     "-e", f"dflash_regenerate_out={OUT}", "-e", json.dumps(job), timeout=1800)
    assert res.rc == 0, res.messages()
    log = [json.loads(line) for line in fleet.read(200, "/var/log/dflash/regenerate.log").splitlines()
           if line.startswith("{")]
    assert log[0]["event"] == "engine" and log[0]["engine"] == "vllm", log[0]
    assert log[0]["python"] == f"{SERVE_VENV}/bin/python"
    assert log[-1]["event"] == "regenerated" and log[-1]["rows"] == len(lines), log[-1]
    rows = [json.loads(line) for line in fleet.read(200, OUT).splitlines()]
    assert sorted(row["id"] for row in rows) == list(range(len(lines)))
    assert all(0 < sum(row["loss_mask"]) <= 16 for row in rows)
    manifest = json.loads(fleet.read(200, f"{OUT}.manifest.json"))
    assert manifest["generation"]["engine"] == "vllm" and manifest["generation"]["dtype"] == "float32"
