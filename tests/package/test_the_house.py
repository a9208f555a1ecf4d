"""The package's layout rules, checked on the source: the arrows between its layers, no import cycle, small
modules (``docs/architecture.md``; the seams are ``test_seams.py``'s)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("lightning_ft", "lightning_ft_job", "lightning_ft_cli")


def modules(package: str) -> dict[str, Path]:
    root = REPO / package
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(path: Path) -> set[str]:
    """Every module a file imports at its top level or in a function, by absolute name (relative imports resolved
    against the file's package)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    package = parts[:-1]  # a module's package; for an __init__.py, the package itself
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_relative_imports_are_resolved_to_absolute_names(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    module = tmp_path / "lightning_ft" / "step" / "protocol.py"
    module.parent.mkdir(parents=True)
    module.write_text("from ..start import decision\nfrom .buffers import ModelBuffers\n")
    assert {"lightning_ft.start", "lightning_ft.start.decision", "lightning_ft.step.buffers"} <= imports_of(module)


def test_the_library_and_the_command_sit_on_the_shared_layer_and_not_on_each_other():
    for name, path in modules("lightning_ft").items():
        assert not any(i.startswith("lightning_ft_cli") for i in imports_of(path)), f"{name} imports the command"
    for name, path in modules("lightning_ft_job").items():
        wrong = {i for i in imports_of(path) if i.split(".")[0] in ("lightning_ft", "lightning_ft_cli", "lightning")}
        assert not wrong, f"{name} imports {wrong}"
    for name, path in modules("lightning_ft_cli").items():
        wrong = {i for i in imports_of(path) if i.split(".")[0] in ("lightning_ft", "lightning")}
        assert not wrong, f"{name} imports {wrong}"


def test_no_import_cycle_between_the_modules_of_the_package():
    known = {**modules("lightning_ft"), **modules("lightning_ft_job"), **modules("lightning_ft_cli")}
    graph = {name: {i for i in imports_of(path) if i in known and i != name} for name, path in known.items()}
    # A package's __init__ importing its own submodules is how a package exports names: not a cycle of modules.
    graph = {name: {i for i in edges if not name.startswith(i + ".")} for name, edges in graph.items()}
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(target) :], target]))
            if target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_no_module_is_long_and_the_strategy_stays_thin():
    lengths = {
        name: len(path.read_text().splitlines()) for package in PACKAGES for name, path in modules(package).items()
    }
    long = {name: n for name, n in lengths.items() if n > 420 and name != "lightning_ft.strategy"}
    assert not long, long
    # The strategy holds hooks and properties; its arguments are defined in lightning_ft/strategy_arguments.py.
    assert lengths["lightning_ft.strategy"] < 500


def test_the_strategy_holds_properties_and_hook_overrides_only():
    """``FTStrategy`` reads like Lightning's ``DDPStrategy``: each public method is a property or an override of a
    Lightning hook (``@override``); the only other public one is ``start_quorum``, a documented entry point that
    goes through the step's owner."""
    tree = ast.parse((REPO / "lightning_ft" / "strategy.py").read_text())
    strategy = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "FTStrategy")
    public = [node for node in strategy.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]
    decorators = {node.name: {ast.unparse(d) for d in node.decorator_list} for node in public}
    plain = sorted(name for name, names in decorators.items() if not names & {"override", "property"})
    assert plain == ["start_quorum"]


def test_no_module_name_appears_twice_in_the_library():
    names = [path.stem for path in modules("lightning_ft").values() if path.stem != "__init__"]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def folder_imports(package: str = "lightning_ft") -> dict[str, set[str]]:
    """For each subpackage (folder) of ``package``, the other subpackages its modules import."""
    known = modules(package)
    folders = {name for name, path in known.items() if path.name == "__init__.py" and name.count(".") == 1}

    def folder(name: str) -> str | None:
        top = ".".join(name.split(".")[:2])
        return top if top in folders else None

    graph: dict[str, set[str]] = {name: set() for name in folders}
    for name, path in known.items():
        source = folder(name)
        if source is None:
            continue
        graph[source] |= {f for i in imports_of(path) if i in known and (f := folder(i)) not in (None, source)}
    return graph


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its nodes in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target, [*path, target])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_no_import_cycle_between_the_folders_of_the_package():
    """Folders name concepts (docs/concepts.md); an arrow both ways between two means neither can be read alone
    (``step/protocol.py`` once imported an error from ``start/``, whose ``lifecycle.py`` drives the protocol)."""
    cycle = cycle_in(folder_imports())
    assert cycle is None, "folder import cycle: " + " -> ".join(cycle or [])


def test_the_folder_cycle_check_finds_a_cycle():
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b"}, "b": set()}) is None


def test_ddp_and_fsdp_inside_a_group_are_two_objects_behind_one_interface():
    """FTStrategy delegates its group-local hooks to one of two objects, never branching on the data parallelism
    itself: each implements every member of ``GroupParallelism`` with the same parameters."""
    import inspect

    from lightning_ft.group_parallelism import GroupDDP, GroupParallelism
    from lightning_ft.hsdp.in_group import GroupFSDP

    members = {name for name in vars(GroupParallelism) if not name.startswith("_")}
    assert {"setup", "block_backward_sync", "lightning_module_state_dict", "device_mesh"} <= members
    for implementation in (GroupDDP, GroupFSDP):
        for name in members - {"device_mesh"}:
            wanted = list(inspect.signature(getattr(GroupParallelism, name)).parameters)
            assert list(inspect.signature(getattr(implementation, name)).parameters) == wanted, (implementation, name)
    source = (REPO / "lightning_ft" / "strategy.py").read_text()
    assert "if self.data_parallel.sharded" not in source and "not self.data_parallel.sharded" not in source


def test_the_architecture_page_names_only_what_exists_and_every_folder():
    """``docs/architecture.md`` stays true to the code: each file it names (``x.py``, ``folder/``, a path) exists in
    the repository, and each folder of the library has its row in the page's table."""
    page = (REPO / "docs" / "architecture.md").read_text()
    every_file = {path.relative_to(REPO).as_posix() for path in REPO.rglob("*.py") if ".venv" not in path.parts}
    missing = []
    for name in sorted(set(re.findall(r"`([A-Za-z_][\w/]*\.py)`", page))):
        if not any(path == name or path.endswith("/" + name) for path in every_file):
            missing.append(name)
    folders = {path.parent.name for path in (REPO / "lightning_ft").glob("*/__init__.py")}
    for name in sorted(set(re.findall(r"`([a-z_]+)/`", page))):
        if name not in folders:
            missing.append(name + "/")
    assert not missing, f"named in docs/architecture.md but not in the code: {missing}"
    absent = sorted(folder for folder in folders if f"`{folder}/`" not in page)
    assert not absent, f"library folders without a row in docs/architecture.md: {absent}"


# Test folders that are not a folder of lightning_ft: the strategy and the top-level modules, whole-job checkpoints,
# the two command-side packages, these layout rules, the shared harness, the benchmark drivers' own tests, and the
# suite's run records.
TEST_FOLDERS_BEYOND_THE_LIBRARY = {"strategy", "checkpoints", "job", "cli", "package", "support", "benchmark_drivers"}


def test_the_tests_mirror_the_package():
    """Every folder of ``lightning_ft`` has a test folder of the same name, and every test folder is one of those or
    a named exception: a maintainer changing ``lightning_ft/<folder>/`` finds its tests in ``tests/<folder>/``."""
    library = {path.name for path in (REPO / "lightning_ft").iterdir() if (path / "__init__.py").is_file()}
    tests = {path.name for path in (REPO / "tests").iterdir() if any(path.glob("test_*.py"))}
    assert library - tests == set(), "library folders without tests"
    assert tests - library - TEST_FOLDERS_BEYOND_THE_LIBRARY == set(), "test folders that mirror nothing"
    assert not list((REPO / "tests").glob("test_*.py")), "a test module outside the folders"


# The step's lifecycle on the protocol, and who may drive it: a step (or a sync) begins, ends and is released only in
# its owner; the vote is taken only by the owner or by what the owner calls for it (the commit-gated optimizer, which
# Lightning's optimizer step reaches through the precision plugin; DiLoCo's sync, whose torchft fragment votes inside
# its own perform_sync and is recorded).
STEP_OWNERS = {"lightning_ft/step/owner.py", "lightning_ft/algorithms/sync_owner.py"}
VOTE_TAKERS = STEP_OWNERS | {"lightning_ft/step/gated_optimizer.py", "lightning_ft/algorithms/diloco.py"}


def step_protocol_calls(source: str) -> list[tuple[int, str]]:
    """``(line, method)`` for each call that begins, ends, releases or votes on a step: ``open_quorum`` on
    anything; ``close``, ``release``, ``commit`` and ``record_commit`` on an expression that names a protocol."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        method, receiver = node.func.attr, ast.unparse(node.func.value)
        if method == "open_quorum" or (
            method in ("close", "release", "commit", "record_commit") and "protocol" in receiver.lower()
        ):
            found.append((node.lineno, method))
    return found


def step_lifecycle_outside_its_owners(files: dict[str, str]) -> list[str]:
    problems = []
    for name, source in files.items():
        for line, method in step_protocol_calls(source):
            allowed = VOTE_TAKERS if method in ("commit", "record_commit") else STEP_OWNERS
            if name not in allowed:
                problems.append(f"{name}:{line}: {method}")
    return problems


def test_every_step_begins_and_ends_in_its_one_owner():
    """Per step or semi-synchronously, a fit's steps have one owner (``StepOwner`` or ``SyncOwner``): nothing else
    opens, closes or releases a step's quorum, and only the owner or what it calls takes the vote. (A sync section's
    quorum, for validation or an epoch end, is not a step: it has no vote; ``step/collectives.py`` opens it on the
    Manager.)"""
    files = {
        path.relative_to(REPO).as_posix(): path.read_text()
        for path in (REPO / "lightning_ft").rglob("*.py")
        if path.name != "protocol.py"
    }
    assert step_lifecycle_outside_its_owners(files) == []
    # It finds the second owner that semi-synchronous steps had: a callback that opened and closed syncs itself.
    callback = "def on_train_batch_start(self, trainer):\n    ft_step_protocol(trainer).open_quorum()\n"
    callback += "    committed = protocol.commit()\n    protocol.close()\n"
    assert step_lifecycle_outside_its_owners({"lightning_ft/callbacks/sync.py": callback}) == [
        "lightning_ft/callbacks/sync.py:2: open_quorum",
        "lightning_ft/callbacks/sync.py:3: commit",
        "lightning_ft/callbacks/sync.py:4: close",
    ]


# Callback modules whose test file is named otherwise: two predate the one-file-per-module rule, and two share their
# module's name with a test file of tests/data/ (test module names are unique across the tests: see below).
CALLBACK_TEST_FILES = {
    "failure_injector": "test_failure_injection.py",
    "monitor": "test_observability.py",
    "data_position": "test_data_position_callback.py",
    "exactly_once": "test_exactly_once_callback.py",
}


def test_each_callback_module_has_its_test_file():
    """Each callback is usable on its own, and tested on its own: ``lightning_ft/callbacks/<m>.py`` has
    ``tests/callbacks/test_<m>.py`` (``_access.py``: ``test_access.py``)."""
    wanted = {
        path.stem: CALLBACK_TEST_FILES.get(path.stem, f"test_{path.stem.lstrip('_')}.py")
        for path in (REPO / "lightning_ft" / "callbacks").glob("*.py")
        if path.name != "__init__.py"
    }
    missing = sorted(
        f"{module}: {name}" for module, name in wanted.items() if not (REPO / "tests" / "callbacks" / name).exists()
    )
    assert not missing, missing


def test_no_test_module_name_appears_twice():
    """Every test folder is on ``sys.path`` and pytest imports each test file by its bare name (tests/conftest.py):
    two files of one name in two folders fail the collection of both, and of any file that imports one of them."""
    names = [path.name for path in (REPO / "tests").rglob("*.py") if path.name not in ("conftest.py", "__init__.py")]
    assert sorted({name for name in names if names.count(name) > 1}) == []
