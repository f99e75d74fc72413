"""The house rules, checked on the source tree itself (docs/decisions.md, "The house").

Dependencies point one way (cluster -> actors -> plans), there is no import cycle anywhere,
`plans/` is pure, imports sit at module level, and the commands a person runs to look at a store
(`rayshard --help`, `ckpt ls`, `ckpt show`) import neither torch nor Ray.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAYERS = ("plans", "actors", "cluster")
# What each layer may import from the others.
ALLOWED = {"plans": {"plans"}, "actors": {"actors", "plans"}, "cluster": {"cluster", "actors", "plans"}}
# plans/ plans: no Ray, no process groups, no storage I/O (torch only for dtypes and shapes).
IMPURE_FOR_PLANS = ("ray", "fsspec", "s3fs", "torch.distributed", "torch.nn", "botocore")


def _modules() -> dict[str, Path]:
    found = {}
    for layer in LAYERS:
        for path in sorted((REPO / layer).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> list[tuple[str, ast.AST, bool]]:
    """(imported module, node, whether at module level) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    module_level = {id(node) for node in tree.body}
    for node in tree.body:  # imports in a module-level try/if (optional dependencies) count as module level
        if isinstance(node, (ast.Try, ast.If)):
            module_level.update(id(child) for child in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node, id(node) in module_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            found += [(name if name in MODULES else node.module, node, id(node) in module_level) for name in names]
    return found


def _internal_graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        graph[name] = {imported for imported, _, _ in _imports(path) if imported in MODULES and imported != name}
    return graph


def test_the_walk_finds_every_layer():
    assert {name.split(".")[0] for name in MODULES} == set(LAYERS)
    assert "plans.checkpoint.manifest" in MODULES and "cluster.cli.main" in MODULES


def test_dependencies_point_one_way():
    wrong = [f"{name} imports {imported}" for name, targets in _internal_graph().items() for imported in targets
             if imported.split(".")[0] not in ALLOWED[name.split(".")[0]]]
    assert not wrong, wrong


def test_no_import_cycles():
    graph = _internal_graph()
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for node in graph:
        if node not in index:
            visit(node)
    assert not cycles, cycles


def test_plans_stay_pure():
    impure = [f"{name} imports {imported}" for name, path in MODULES.items() if name.startswith("plans")
              for imported, _, _ in _imports(path)
              if any(imported == bad or imported.startswith(bad + ".") for bad in IMPURE_FOR_PLANS)]
    assert not impure, impure


def test_imports_sit_at_module_level():
    """No function-level import tricks: what a module needs it imports at the top, so its cost and
    its dependencies are visible. (The CLI's dispatcher imports a command's module by name.)"""
    deferred = [f"{path.relative_to(REPO)}:{node.lineno} imports {imported}" for path in MODULES.values()
                for imported, node, at_top in _imports(path) if not at_top]
    assert not deferred, deferred


LIGHT_COMMANDS = {
    "help": ["--help"],
    "ckpt ls": ["ckpt", "ls", "--store", "{store}"],
    "ckpt show": ["ckpt", "show", "light@2", "--store", "{store}"],
}


@pytest.fixture(scope="module")
def store_with_a_checkpoint(tmp_path_factory):
    from plans.training.model_spec import preset
    from tests.unit.checkpoint_factory import write_checkpoint

    store = tmp_path_factory.mktemp("light-store")
    write_checkpoint(str(store), "light", preset("tiny"), steps=2)
    return store


@pytest.mark.parametrize("command", sorted(LIGHT_COMMANDS))
def test_looking_at_a_store_imports_neither_torch_nor_ray(command, store_with_a_checkpoint):
    argv = [arg.format(store=store_with_a_checkpoint) for arg in LIGHT_COMMANDS[command]]
    probe = ("import sys\nfrom cluster.cli.main import main\n"
             f"try:\n    code = main({argv!r})\nexcept SystemExit as exit:\n    code = exit.code\n"
             "heavy = sorted(m for m in ('torch', 'ray') if m in sys.modules)\n"
             "print('HEAVY', heavy, 'CODE', code)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "HEAVY [] CODE 0" in done.stdout, done.stdout + done.stderr
