"""make test-flaky's tool reruns a test under load and counts its failures per test (scripts/flaky.py)."""

import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import flaky  # noqa: E402

# A test that fails every second run (a counter file beside it), and one that always passes.
ALTERNATING = '''
from pathlib import Path

COUNTER = Path(__file__).with_name("runs")


def test_fails_every_second_run():
    runs = int(COUNTER.read_text()) if COUNTER.exists() else 0
    COUNTER.write_text(str(runs + 1))
    assert runs % 2 == 0, f"run {runs} is odd"


def test_passes():
    pass
'''


def test_the_repeat_suffix_is_taken_off_plain_and_parametrized_names():
    assert flaky.base_name("test_x[3-20]") == "test_x"
    assert flaky.base_name("test_x[dead-3-20]") == "test_x[dead]"
    assert flaky.base_name("test_x[dead]") == "test_x[dead]"


def test_a_test_that_fails_every_second_run_shows_half_its_runs_failed(tmp_path, capsys):
    (tmp_path / "test_alternating.py").write_text(ALTERNATING)
    test_file = str(tmp_path / "test_alternating.py")
    status = flaky.main([test_file, "--runs", "6", "--workers", "1", "--hogs", "1"])
    shown = capsys.readouterr().out
    assert status == 1, shown
    # A row per test: runs, failed, rate, then the test's id (its class path depends on pytest's rootdir).
    rows = {line.split()[3].rpartition("::")[2]: line.split()[:3] for line in shown.splitlines()
            if "test_alternating" in line and "::" in line}
    assert rows.get("test_fails_every_second_run") == ["6", "3", "50.0%"], shown
    assert rows.get("test_passes") == ["6", "0", "0.0%"], shown
    assert "first failure: AssertionError: run 1 is odd" in shown


def test_only_passing_runs_exit_zero(tmp_path, capsys):
    (tmp_path / "test_fine.py").write_text("def test_fine():\n    pass\n")
    assert flaky.main([str(tmp_path / "test_fine.py"), "--runs", "2", "--workers", "1", "--hogs", "0"]) == 0
    assert "2      0   0.0%" in capsys.readouterr().out
