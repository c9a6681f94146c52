"""A run whose config names an MLflow tracking server logs its params and metrics there too: a real
`mlflow server` (sqlite in a temporary directory, on 127.0.0.1; `make mlflow-server` builds its venv) is read
back through MlflowClient; a resumed run goes on in the same MLflow run; `report_to: [mlflow]` takes the
server from MLFLOW_TRACKING_URI; a server that does not answer costs figures, not the run. A run without it
imports nothing of MLflow, and validate refuses a config that names one in a venv without the client."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from dflash_ops.config import main as config_main
from dflash_ops.core.config import config_from_dict
from dflash_ops.run.main import run_single_process
from dflash_ops.training.mlflow_tracking import RUN_FILE
from dflash_ops.training.telemetry import METRICS_FILE
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[3]
SERVER = REPO / ".cache" / "mlflow-venv" / "bin" / "mlflow"
CLIENT = importlib.util.find_spec("mlflow") is not None
needs_client = pytest.mark.skipif(not CLIENT, reason="the mlflow extra is not installed (.[mlflow])")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real MLflow tracking server on 127.0.0.1 with a sqlite store; stopped by its process group."""
    if not CLIENT:
        pytest.skip("the mlflow extra is not installed")
    assert SERVER.exists(), f"{SERVER} is missing: make mlflow-server builds it"
    home = tmp_path_factory.mktemp("mlflow-server")
    url = f"http://127.0.0.1:{free_port()}"
    with open(home / "server.log", "wb") as log:
        process = subprocess.Popen(
            [str(SERVER), "server", "--backend-store-uri", f"sqlite:///{home}/mlflow.db",
             "--default-artifact-root", str(home / "artifacts"), "--host", "127.0.0.1",
             "--port", url.rsplit(":", 1)[1], "--workers", "1"],
            cwd=home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Its first start creates the sqlite schema (alembic's migrations): a minute on a loaded machine.
        assert wait_for(lambda: healthy(url) or process.poll() is not None, timeout=300, interval=0.5)
        assert process.poll() is None, (home / "server.log").read_text()[-3000:]
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def train(raw: dict) -> list[dict]:
    assert run_single_process(config_from_dict(raw)) == 0
    out = Path(raw["run"]["output_dir"])
    return [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]


def mlflow_run(url: str, output_dir: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=url)
    run_id = json.loads((output_dir / RUN_FILE).read_text())["run_id"]
    return client, client.get_run(run_id)


def history(client, run_id: str, tag: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, tag)}


@pytest.mark.slow
@needs_client
def test_params_and_metrics_reach_a_real_server_and_a_resume_goes_on_in_the_same_run(
        server, tiny_config, tiny_eval_dataset, tmp_path):
    out = tmp_path / "run"
    raw = tiny_config(out, optim={"total_steps": 4}, run={"mlflow_uri": server, "eval_every": 2})
    raw["data"].update(eval_path=str(tiny_eval_dataset), eval_examples=3)
    metrics = train(raw)
    client, run = mlflow_run(server, out)
    assert client.get_experiment(run.info.experiment_id).name == "dflash" and run.info.status == "FINISHED"
    assert run.data.params["optim.total_steps"] == "4" and run.data.params["run.mlflow_uri"] == server
    assert run.data.params["model.block_size"] == "4" and run.data.params["run.output_dir"] == str(out)
    train_lines = {m["step"]: m for m in metrics if m["kind"] == "train"}
    loss = history(client, run.info.run_id, "train/loss")
    assert loss == pytest.approx({step: m["loss"] for step, m in train_lines.items()})
    assert sorted(loss) == [1, 2, 3, 4]
    taus = history(client, run.info.run_id, "heldout/heldout_tau")
    assert taus == pytest.approx({m["step"]: m["heldout_tau"] for m in metrics if m["kind"] == "heldout"})
    assert sorted(taus) == [2, 4]

    # Resumed with more steps: the same MLflow run, its params kept, steps 5 and 6 added.
    raw["optim"]["total_steps"] = 6
    train(raw)
    client, resumed = mlflow_run(server, out)
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    assert resumed.data.params["optim.total_steps"] == "4"
    assert sorted(history(client, run.info.run_id, "train/loss")) == [1, 2, 3, 4, 5, 6]
    assert len(client.search_runs([run.info.experiment_id])) == 1


@pytest.mark.slow
@needs_client
def test_report_to_mlflow_takes_the_server_from_the_environment(server, tiny_config, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    out = tmp_path / "run"
    metrics = train(tiny_config(out, optim={"total_steps": 2}, run={"report_to": ["tensorboard", "mlflow"],
                                                                   "mlflow_experiment": "specforge-style"}))
    client, run = mlflow_run(server, out)
    assert client.get_experiment(run.info.experiment_id).name == "specforge-style"
    assert history(client, run.info.run_id, "train/loss") == pytest.approx(
        {m["step"]: m["loss"] for m in metrics if m["kind"] == "train"})


@pytest.mark.slow
@needs_client
def test_a_server_that_does_not_answer_costs_figures_not_the_run(tiny_config, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    out = tmp_path / "run"
    silent = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    metrics = train(tiny_config(out, optim={"total_steps": 3}, run={"mlflow_uri": silent}))
    assert [m["step"] for m in metrics if m["kind"] == "train"] == [1, 2, 3]
    warnings = [json.loads(line)["message"] for line in capsys.readouterr().out.splitlines()
                if line.startswith("{") and '"warning"' in line]
    assert any(w.startswith("MLflow at http://127.0.0.1:") and "fails" in w for w in warnings), warnings
    assert not (out / RUN_FILE).exists()


@pytest.mark.slow
def test_a_run_without_mlflow_imports_nothing_of_it(tiny_config, tmp_path):
    raw = tiny_config(tmp_path / "run", optim={"total_steps": 2})
    code = ("import json, sys\n"
            "from dflash_ops.core.config import config_from_dict\n"
            "from dflash_ops.run.main import run_single_process\n"
            f"assert run_single_process(config_from_dict(json.loads({json.dumps(json.dumps(raw))}))) == 0\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlflow'))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize("run", [{"mlflow_uri": "http://127.0.0.1:5000"}, {"report_to": ["mlflow"]}])
def test_validate_refuses_mlflow_in_a_venv_without_its_client(run, tiny_config, tmp_path, monkeypatch,
                                                               capsys):
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(tiny_config(tmp_path / "run", run=run)))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "mlflow" else real(name, *args))
    assert config_main(["validate", "--no-target-check", "--json", str(config)]) == 2
    answer = json.loads(capsys.readouterr().out)
    key = "run.mlflow_uri" if "mlflow_uri" in run else "run.report_to"
    assert answer["key"] == key and "pip install 'dflash-ops[mlflow]'" in answer["message"], answer
    monkeypatch.setattr(importlib.util, "find_spec", real)
    if CLIENT:
        assert config_main(["validate", "--no-target-check", "--json", str(config)]) == 0


def test_report_to_names_only_what_the_run_can_send_to(tiny_config, tmp_path):
    with pytest.raises(ValueError, match=r"run.report_to: must list trackers among tensorboard, mlflow"):
        config_from_dict(tiny_config(tmp_path / "run", run={"report_to": ["wandb"]}))
    with pytest.raises(ValueError, match=r"run.mlflow_uri: must be a tracking URI with its scheme"):
        config_from_dict(tiny_config(tmp_path / "run", run={"mlflow_uri": "mlflow.lab"}))
