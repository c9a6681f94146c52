"""docs/PVESIM.md: every row of its tables names, in its test column, tests that exist."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "PVESIM.md"
TESTS = REPO / "tests"


def rows():
    """(line number, cells) of every table row but the header and the separator."""
    for number, line in enumerate(DOC.read_text().splitlines(), 1):
        if not line.startswith("|") or set(line) <= set("|-: ") or line.startswith("| pvesim | real node"):
            continue
        yield number, [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]


def file_of(name):
    """The test file a reference names: a path under the repo, or a file name unique under tests/."""
    if name.startswith("tests/"):
        return REPO / name if (REPO / name).is_file() else None
    found = list(TESTS.rglob(name))
    return found[0] if len(found) == 1 else None


def defines(path, name):
    """Whether the file defines test `name` (`...` at its end: a prefix; `[...]`: its parameters)."""
    name = re.sub(r"\[[^\]]*\]$", "", name)
    pattern = re.escape(name[:-3]) + r"\w*" if name.endswith("...") else re.escape(name)
    return re.search(rf"^def {pattern}\(", path.read_text(), re.M) is not None


def missing_tests(cell):
    """The references of a test cell that name no existing test; (count of references, missing)."""
    refs = [r for r in re.findall(r"`([^`]+)`", cell) if "test_" in r]
    missing, context = [], None
    for ref in refs:
        if "::" in ref:
            file, _, name = ref.rpartition("::")
        else:
            file, name = (ref, "") if ref.endswith(".py") else ("", ref)
        path = file_of(file) if file else context
        if file:
            context = path
        if path is None:
            missing.append(ref)
        elif name and not defines(path, name):
            missing.append(ref)
    return len(refs), missing


def test_every_row_names_tests_that_exist():
    checked = 0
    for number, cells in rows():
        assert len(cells) == 4, f"docs/PVESIM.md:{number}: {len(cells)} cells"
        if cells[0].startswith("Not modelled"):
            continue
        count, missing = missing_tests(cells[3])
        assert count, f"docs/PVESIM.md:{number} names no test"
        assert not missing, f"docs/PVESIM.md:{number}: no such test: {missing}"
        checked += 1
    assert checked >= 20
