"""The house rules, checked on the source tree itself (docs/decisions.md, "The house").

Dependencies point one way (cluster -> actors -> storage -> plans), there is no import cycle
anywhere, `plans/` is pure, the storage layer imports neither torch nor Ray, imports sit at module
level, the commands a person runs to look at a store (`rayshard --help`, `ckpt ls`, `ckpt show`)
import neither torch nor Ray, and a built wheel installs `rayshard` and nothing else at top level.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.built_wheel import build_wheel, unpack

REPO = Path(__file__).resolve().parents[2]
LAYERS = ("plans", "storage", "actors", "cluster")
# What each layer may import from the others.
ALLOWED = {"plans": {"plans"}, "storage": {"storage", "plans"}, "actors": {"actors", "storage", "plans"},
           "cluster": {"cluster", "actors", "storage", "plans"}}
# plans/ plans: no Ray, no process groups, no storage I/O (torch only for dtypes and shapes).
IMPURE_FOR_PLANS = ("ray", "fsspec", "s3fs", "torch.distributed", "torch.nn", "botocore")
# storage/ moves bytes: a driver that only looks at a store, and any training loop, import it without torch or Ray.
IMPURE_FOR_STORAGE = ("ray", "torch")


def _modules() -> dict[str, Path]:
    found = {}
    for layer in LAYERS:
        for path in sorted((REPO / layer).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(("rayshard",) + (parts[:-1] if parts[-1] == "__init__" else parts))] = path
    return found


MODULES = _modules()


def _layer(module: str) -> str:
    return module.split(".")[1]


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
    assert {_layer(name) for name in MODULES} == set(LAYERS)
    assert "rayshard.plans.checkpoint.manifest.codec" in MODULES and "rayshard.cluster.cli.main" in MODULES


def test_dependencies_point_one_way():
    wrong = [f"{name} imports {imported}" for name, targets in _internal_graph().items() for imported in targets
             if _layer(imported) not in ALLOWED[_layer(name)]]
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


@pytest.mark.parametrize("layer, forbidden", [("plans", IMPURE_FOR_PLANS), ("storage", IMPURE_FOR_STORAGE)])
def test_lower_layers_stay_pure(layer, forbidden):
    impure = [f"{name} imports {imported}" for name, path in MODULES.items() if _layer(name) == layer
              for imported, _, _ in _imports(path)
              if any(imported == bad or imported.startswith(bad + ".") for bad in forbidden)]
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
    from rayshard.plans.training.model_spec import preset
    from tests.unit.checkpoint_factory import write_checkpoint

    store = tmp_path_factory.mktemp("light-store")
    write_checkpoint(str(store), "light", preset("tiny"), steps=2)
    return store


@pytest.mark.parametrize("command", sorted(LIGHT_COMMANDS))
def test_looking_at_a_store_imports_neither_torch_nor_ray(command, store_with_a_checkpoint):
    argv = [arg.format(store=store_with_a_checkpoint) for arg in LIGHT_COMMANDS[command]]
    probe = ("import sys\nfrom rayshard.cluster.cli.main import main\n"
             f"try:\n    code = main({argv!r})\nexcept SystemExit as exit:\n    code = exit.code\n"
             "heavy = sorted(m for m in ('torch', 'ray') if m in sys.modules)\n"
             "print('HEAVY', heavy, 'CODE', code)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "HEAVY [] CODE 0" in done.stdout, done.stdout + done.stderr


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory):
    return build_wheel(tmp_path_factory.mktemp("wheel-build"))


def test_the_wheel_installs_rayshard_alone_at_top_level(built_wheel):
    with zipfile.ZipFile(built_wheel) as archive:
        names = archive.namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"rayshard"}, top_level
    for layer in LAYERS:
        assert f"rayshard/{layer}/__init__.py" in names
    assert "rayshard/configs/demo.yaml" in names and "rayshard/__main__.py" in names


def test_the_installed_wheel_runs_and_finds_its_shipped_config(built_wheel, tmp_path):
    """Unpacked where nothing of the checkout is on the path: `python -m rayshard` runs from the
    wheel's files, and the default config is the packaged one, not the checkout's."""
    target = unpack(built_wheel, tmp_path / "site")
    probe = ("import rayshard, rayshard.cluster.cli.train as train\n"
             "print(rayshard.__file__)\nprint(train.DEFAULT_CONFIG)\nprint(sorted(rayshard.__all__)[:2])\n")
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r})\n" + probe],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    module_file, default_config, _ = done.stdout.splitlines()
    assert module_file.startswith(str(target)) and default_config.startswith(str(target)), done.stdout
    assert Path(default_config).is_file()
    help_run = subprocess.run([sys.executable, "-m", "rayshard", "--help"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, env=env)
    assert help_run.returncode == 0 and "train" in help_run.stdout, help_run.stderr


def _folder(module: str) -> str:
    """The room a module lives in: its layer and first folder (`rayshard.plans.checkpoint` for
    anything under plans/checkpoint/); a module at the layer's top (plans/errors.py) is a room of
    its own."""
    parts = module.split(".")
    path = MODULES[module]
    depth = len(path.relative_to(REPO).parts)  # plans/x.py: 2; plans/checkpoint/x.py: 3 or more
    if path.name == "__init__.py":
        depth -= 1
    return ".".join(parts[:3]) if depth >= 3 else module


def test_no_import_loops_between_folders():
    """Module cycles are refused above; a loop between rooms (training importing checkpoint's
    transforms while checkpoint imports training) hides behind acyclic modules, so rooms are
    checked too."""
    graph: dict[str, set[str]] = {}
    for name, targets in _internal_graph().items():
        graph.setdefault(_folder(name), set()).update(_folder(t) for t in targets if _folder(t) != _folder(name))
    loops = []
    for start in graph:  # a few dozen rooms: a search from each is cheap
        stack, seen = [(start, [start])], set()
        while stack:
            room, path = stack.pop()
            for target in graph.get(room, ()):
                if target == start:
                    loops.append(" -> ".join(path + [start]))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, path + [target]))
    assert not loops, sorted(set(loops))[:10]
