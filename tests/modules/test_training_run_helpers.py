"""Unit tests of training_run's pure helpers (the collection's module_utils): /proc parsing, pidfile
verdicts and edge cases, the choice of processes to signal."""

from __future__ import annotations

import json
import os
import re
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ansible_collections.dflash.ops.plugins.module_utils import run_pidfile, run_proc, run_start, safe_paths

PLUGINS = Path(__file__).resolve().parents[2] / "ansible_collections" / "dflash" / "ops" / "plugins"


def stat_line(pid, comm, state="S", ppid=1, pgid=None, start_time=1000):
    """A /proc/<pid>/stat line: fields 1..52, with the ones the module reads set."""
    fields = [state, str(ppid), str(pgid or pid), str(pgid or pid)] + ["0"] * 15 + [str(start_time)]
    return f"{pid} ({comm}) " + " ".join(fields + ["0"] * 30)


def fake_proc(tmp_path, entries):
    """A directory shaped like /proc with the given stat lines (pid -> kwargs of stat_line)."""
    root = tmp_path / "proc"
    for pid, kwargs in entries.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "stat").write_text(stat_line(pid, **kwargs))
    (root / "self").mkdir(parents=True, exist_ok=True)  # non-numeric entries are skipped
    return str(root)


def test_parse_stat_counts_fields_after_the_last_parenthesis():
    # A command name with spaces and ')' would shift every field if split naively.
    line = stat_line(4242, "evil) S 1 2 3 (name", state="R", ppid=7, pgid=4200, start_time=987654)
    parsed = run_proc.parse_stat(line)
    assert parsed == run_proc.ProcStat("R", 7, 4200, 987654)


def test_parse_stat_of_the_real_current_process():
    with open("/proc/self/stat") as stat_file:
        parsed = run_proc.parse_stat(stat_file.read())
    assert parsed.ppid == os.getppid()
    assert parsed.pgid == os.getpgid(0)
    assert parsed.start_time > 0


@pytest.mark.parametrize("text", ["", "garbage without parenthesis", "1 (x) S 1 2"])
def test_parse_stat_rejects_truncated_lines(text):
    assert run_proc.parse_stat(text) is None


@pytest.mark.parametrize(
    "stat_kwargs, verdict",
    [
        (None, "dead"),
        (dict(state="S", start_time=500), "live"),
        (dict(state="Z", start_time=500), "zombie"),
        (dict(state="X", start_time=500), "zombie"),
        (dict(state="S", start_time=501), "reused"),
    ],
)
def test_pidfile_verdict(stat_kwargs, verdict):
    record = {"pid": 10, "pgid": 10, "start_time": 500}
    stat_value = None if stat_kwargs is None else run_proc.parse_stat(stat_line(10, "run", **stat_kwargs))
    assert run_pidfile.pidfile_verdict(record, stat_value) == verdict


def test_run_members_takes_the_group_and_escaped_descendants_only(tmp_path):
    root = fake_proc(tmp_path, {
        100: dict(comm="run.sh", ppid=1, pgid=100, start_time=10),
        101: dict(comm="python", ppid=100, pgid=100, start_time=11),         # group member
        102: dict(comm="worker", ppid=101, pgid=102, start_time=12),         # left the group (setsid)
        103: dict(comm="helper", ppid=102, pgid=102, start_time=13),         # child of the escaped one
        104: dict(comm="old", ppid=1, pgid=100, start_time=14),              # orphaned group member
        105: dict(comm="zombie", ppid=101, pgid=100, state="Z", start_time=15),
        200: dict(comm="bash -c 'pkill -f run.sh'", ppid=1, pgid=200, start_time=20),  # decoy
        201: dict(comm="run.sh", ppid=200, pgid=200, start_time=21),         # decoy, same name
    })
    table = run_proc.process_table(root)
    members = run_proc.run_members(table, pgid=100, roots=[100])
    assert members == {100: 10, 101: 11, 102: 12, 103: 13, 104: 14}


def test_run_members_never_includes_protected_processes(tmp_path):
    root = fake_proc(tmp_path, {
        100: dict(comm="run", ppid=1, pgid=100),
        101: dict(comm="ansible module", ppid=100, pgid=100),
    })
    assert run_proc.run_members(run_proc.process_table(root), 100, [100], protected={101}) == {100: 1000}


def test_still_running_drops_pids_whose_start_time_changed(tmp_path):
    root = fake_proc(tmp_path, {
        100: dict(comm="run", start_time=10),
        101: dict(comm="reused", start_time=99),
        102: dict(comm="zombie", state="Z", start_time=12),
    })
    tracked = {100: 10, 101: 11, 102: 12, 103: 13}
    assert run_proc.still_running(tracked, run_proc.process_table(root)) == [100]


def test_self_and_ancestors_contains_this_process_and_its_parent():
    protected = run_proc.self_and_ancestors()
    assert {os.getpid(), os.getppid()} <= protected
    assert 1 not in protected


def write_json(path, data):
    path.write_text(json.dumps(data))
    return str(path)


def test_load_pidfile_absent_is_none(tmp_path):
    assert run_pidfile.load_pidfile(str(tmp_path / "none.pid")) == (None, None)


@pytest.mark.parametrize(
    "content, problem",
    [
        ("", "is empty"),
        ("  \n", "is empty"),
        ("12345\n", "does not hold a JSON object"),          # a classic bare-pid pidfile
        ('{"pid": 5, "pgid"', "is not JSON"),                  # truncated
        ("{not json", "is not JSON"),
        ('{"pid": 5, "pgid": 5}', "no valid 'start_time'"),
        ('{"pid": "5", "pgid": 5, "start_time": 1}', "no valid 'pid'"),
        ('{"pid": true, "pgid": 5, "start_time": 1}', "no valid 'pid'"),
        ('{"pid": 0, "pgid": 5, "start_time": 1}', "no valid 'pid'"),
        ('{"pid": 5, "pgid": -1, "start_time": 1}', "no valid 'pgid'"),
    ],
)
def test_a_pidfile_it_did_not_write_names_nothing(tmp_path, content, problem):
    path = tmp_path / "run.pid"
    path.write_text(content)
    path.chmod(0o644)
    record, unsafe = run_pidfile.load_pidfile(str(path))
    assert isinstance(record, run_pidfile.Unreadable) and problem in record.problem
    assert unsafe is None


def test_load_pidfile_reads_a_record(tmp_path):
    path = tmp_path / "run.pid"
    path.write_text('{"pid": 5, "pgid": 5, "start_time": 1}')
    path.chmod(0o644)
    assert run_pidfile.load_pidfile(str(path)) == ({"pid": 5, "pgid": 5, "start_time": 1}, None)


def fake_stat(mode, uid=0):
    return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))


@pytest.mark.parametrize(
    "file_mode, dir_mode, uid, reason",
    [
        (stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755, 0, None),
        (stat.S_IFREG | 0o600, stat.S_IFDIR | 0o1777, 0, None),     # sticky /tmp-like directory
        (stat.S_IFREG | 0o666, stat.S_IFDIR | 0o755, 0, "writable by other users (mode 0666)"),
        (stat.S_IFREG | 0o664, stat.S_IFDIR | 0o755, 0, "writable by other users (mode 0664)"),
        (stat.S_IFREG | 0o644, stat.S_IFDIR | 0o757, 0, "directory every user can write to"),
        (stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755, 1000, "owned by uid 1000"),
        (stat.S_IFLNK | 0o777, stat.S_IFDIR | 0o755, 0, "not a regular file"),
    ],
)
def test_unsafe_reason(file_mode, dir_mode, uid, reason):
    found = safe_paths.unsafe_reason(fake_stat(file_mode, uid), fake_stat(dir_mode), 0)
    assert (found is None) if reason is None else (reason in found)


def test_set_aside_keeps_the_file_under_a_dated_name(tmp_path):
    path = tmp_path / "run.pid"
    path.write_text("garbage")
    aside = run_pidfile.set_aside(str(path))
    assert not path.exists()
    assert aside.startswith(str(path) + ".unreadable-") and open(aside).read() == "garbage"


def test_log_watcher_finds_the_first_matching_line_after_the_offset(tmp_path):
    log = tmp_path / "run.log"
    log.write_text('{"event": "step", "step": 1}\n')
    watcher = run_start.LogWatcher(str(log), log.stat().st_size, r'"event": *"step"')
    assert watcher.poll() is None                          # the old run's step does not count
    with log.open("a") as f:
        f.write('{"event": "start"}\n{"event": "st')
    assert watcher.poll() is None                          # half a line is not a match yet
    with log.open("a") as f:
        f.write('ep", "step": 11}\n')
    assert watcher.poll() == '{"event": "step", "step": 11}'


def test_environment_file_must_be_private_and_well_formed(tmp_path):
    path = tmp_path / "run.env"
    path.write_text("# tokens\nHF_TOKEN=abc=def\n\nWANDB_API_KEY=x\n")
    path.chmod(0o600)
    if os.geteuid() == path.stat().st_uid:
        assert run_start.read_environment_file(str(path)) == {"HF_TOKEN": "abc=def", "WANDB_API_KEY": "x"}
    path.chmod(0o640)
    with pytest.raises(run_pidfile.RunError, match="chmod 0600"):
        run_start.read_environment_file(str(path))
    path.chmod(0o600)
    path.write_text("export HF_TOKEN abc\n")
    with pytest.raises(run_pidfile.RunError, match="line 1 is not KEY=VALUE"):
        run_start.read_environment_file(str(path))


def test_write_pidfile_is_atomic_and_world_readable(tmp_path):
    path = tmp_path / "run.pid"
    path.write_text("old")
    record = {"pid": 7, "pgid": 7, "start_time": 3, "argv": ["x"]}
    run_pidfile.write_pidfile(str(path), record)
    assert json.loads(path.read_text()) == record
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert path.stat().st_uid == os.geteuid()
    assert [p.name for p in tmp_path.iterdir()] == ["run.pid"]  # no temp file left behind


def test_write_pidfile_leaves_the_old_file_when_it_cannot_serialise(tmp_path):
    path = tmp_path / "run.pid"
    path.write_text("old")
    with pytest.raises(TypeError):
        run_pidfile.write_pidfile(str(path), {"pid": object()})
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["run.pid"]


def test_uptime_from_started_at():
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    started = (now - timedelta(seconds=90)).isoformat()
    assert run_pidfile.uptime_seconds({"started_at": started}, now=now) == 90.0
    assert run_pidfile.uptime_seconds({}, now=now) is None
    assert run_pidfile.uptime_seconds({"started_at": "yesterday"}, now=now) is None


def test_resolve_program(tmp_path):
    script = tmp_path / "bin" / "run.sh"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    plain = tmp_path / "plain.txt"
    plain.write_text("")
    assert run_start.resolve_program(str(script), None, {}) == str(script)
    assert run_start.resolve_program("bin/run.sh", str(tmp_path), {}) == str(script)
    assert run_start.resolve_program("run.sh", None, {"PATH": str(script.parent)}) == str(script)
    assert run_start.resolve_program("run.sh", None, {"PATH": "/nonexistent"}) is None
    assert run_start.resolve_program(str(plain), None, {}) is None  # not executable
    assert run_start.resolve_program(str(tmp_path), None, {}) is None  # a directory


def test_log_tail_keeps_the_end(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("x" * 10000 + "the error\n")
    tail = run_start.log_tail(str(log), limit=100)
    assert tail.endswith("the error\n") and len(tail) == 100
    assert run_start.log_tail(str(tmp_path / "missing.log")) == ""


@pytest.mark.parametrize("module", ["modules/training_run.py", "modules/gpu_verify.py",
                                    "module_utils/gpu_state.py", "module_utils/run_proc.py",
                                    "module_utils/run_pidfile.py",
                                    "module_utils/run_stop.py", "module_utils/run_start.py",
                                    "module_utils/run_state.py"])
def test_modules_never_choose_processes_by_name_or_command_line(module):
    source = (PLUGINS / module).read_text()
    for tool in ("pkill", "pgrep", "killall", "pidof"):
        assert tool not in source, f"{module} mentions {tool}"
    # cmdline, comm and exe are how a process would be chosen by name; the modules read only
    # stat (training_run) and cgroup/status (gpu_verify).
    assert not re.search(r"/(cmdline|comm|exe)\b", source), f"{module} reads a process name"
    assert "psutil" not in source and '"ps"' not in source
