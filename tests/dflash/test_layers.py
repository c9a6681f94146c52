"""The trainer's layers (docs/ARCHITECTURE.md) hold: every import in dflash_ops/, deferred ones included,
goes to the importer's own subpackage or to a layer below it, `run` and `serve` never import each
other, nothing imports a command (the modules at dflash_ops/'s top), and no import circle exists."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "dflash_ops"
# Lower layers first; subpackages on one rank are peers that must not import each other.
LAYERS = {"core": 0, "model": 1, "data": 2, "training": 3, "run": 4, "serve": 4}
COMMANDS_RANK = 5


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The dflash modules `path` (module `name`) imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return {m for m in found if m in known and m != name}


def rank(name: str) -> tuple[int, str]:
    parts = name.split(".")
    if len(parts) == 1:
        return -1, "dflash"  # the package's own __init__: imports nothing
    if len(parts) == 2 and parts[1] not in LAYERS:
        return COMMANDS_RANK, "commands"
    return LAYERS[parts[1]], parts[1]


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imported(path, name, set(found)) for name, path in found.items()}


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    problems = []
    for importer, targets in sorted(edges.items()):
        (own, own_pkg) = rank(importer)
        for target in sorted(targets):
            (other, other_pkg) = rank(target)
            if other_pkg == "dflash" or (own_pkg == other_pkg and own_pkg != "commands"):
                continue
            if other == COMMANDS_RANK:
                problems.append(f"{importer} imports the command {target}")
            elif other >= own:
                problems.append(f"{importer} ({own_pkg}) imports {target} ({other_pkg}): "
                                f"{'a peer' if other == own else 'an upper layer'}")
    return problems


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, as the modules on it (Tarjan's strongly connected components)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_module_is_in_a_layer_or_is_a_command():
    for name in modules():
        parts = name.split(".")
        assert len(parts) <= 3, f"{name}: the layers are one level deep"
        if len(parts) == 3:
            assert parts[1] in LAYERS, f"{name}: {parts[1]} is not a layer of docs/ARCHITECTURE.md"


def test_imports_go_down_the_layers():
    assert layer_violations(graph()) == []


def test_no_import_circle():
    assert circles(graph()) == []


def test_the_checks_see_an_upward_import_and_a_circle():
    # The rule's own check: the import that was removed (heldout took acceptance counting from serve)
    # and a circle like the one data -> regenerate -> target -> data was.
    edges = {"dflash_ops.training.heldout": {"dflash_ops.serve.evaluate"},
             "dflash_ops.data.examples": {"dflash_ops.data.regenerate"},
             "dflash_ops.data.regenerate": {"dflash_ops.data.target"},
             "dflash_ops.data.target": {"dflash_ops.data.examples"}}
    assert layer_violations(edges) == [
        "dflash_ops.training.heldout (training) imports dflash_ops.serve.evaluate (serve): an upper layer"]
    assert circles(edges) == [["dflash_ops.data.examples", "dflash_ops.data.regenerate",
                               "dflash_ops.data.target"]]
    # deferred and `from pkg import mod` imports count
    assert "dflash_ops.run.main" in graph()["dflash_ops.train"]
