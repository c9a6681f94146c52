"""The reliability slice names a case of every file of the suite (make test checks the names; the slice's
own collection checks that each names a collected test, parameters included)."""

import ast
from pathlib import Path

from tests.reliability.slice_cases import SLICE

HERE = Path(__file__).resolve().parent


def functions_of(path):
    """The names of the module-level test functions of `path` (test_playbooks_container_driver.py takes
    its tests from tests/roles/test_playbooks.py)."""
    names = {node.name for node in ast.parse(path.read_text()).body
             if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    suite = HERE.parent / "roles" / "test_playbooks.py"
    return names | (functions_of(suite) if "test_playbooks.py" in path.read_text() else set())


def test_every_file_of_the_suite_has_its_case_in_the_slice():
    files = {p.name for p in HERE.glob("test_*.py")}
    assert sorted(files - set(SLICE)) == [], "a file of the suite without its case in slice_cases.py"
    assert sorted(set(SLICE) - files) == [], "slice_cases.py names a file the suite does not have"
    for name, case in SLICE.items():
        assert case.split("[")[0] in functions_of(HERE / name), f"{name} has no test {case}"
