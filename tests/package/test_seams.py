"""The seams, guarded by construction: every private name (``_x``, not a dunder) that lightning-ft reaches on torch,
torchft or Lightning is found from the code's syntax and the installed packages' sources, and must sit in that
package's seam module with a row in its ``PRIVATE_USES`` (``docs/architecture.md``).

The rules, each checked on the syntax (``ast``) of ``lightning_ft``, ``lightning_ft_job`` and ``lightning_ft_cli``:

* the foreign index: every private name defined in the installed torch, torchft and Lightning sources (``lightning``,
  ``lightning_fabric``/``pytorch_lightning`` ship inside it, and ``lightning_utilities``) as a ``def``, a ``class``, an
  assignment to a module-level or class-level name, or to an attribute (``self._x = ...``, ``obj._x = ...``);
  each foreign class with its private members and its bases (by name);
* the project's own: the same, over the three packages;
* a use: ``X._name`` (read, write or call), ``getattr``/``setattr``/``hasattr``/``delattr`` with ``"_name"`` (a
  literal, or a module-level string constant), ``from pkg import _name``, ``import pkg._module`` (each private
  part of a foreign module's dotted name), and a ``def _name`` in a project class that overrides a private method
  of one of its foreign base classes;
* a use is foreign when ``_name`` is in the foreign index and: its expression is rooted in a name imported from a
  foreign package; or it is ``self._name``/``cls._name`` in a project class that does not define ``_name`` itself
  (nor a project base class of it) — an inherited attribute; or its base is anything else (a local, a call) —
  ambiguous, so foreign unless ``PROJECT_OWN`` lists it as the project's own (module, name). A use rooted in a name
  imported from any other package (the standard library) is not checked;
* its package: the one its root was imported from; else the foreign bases of ``self``'s class that define it; else
  every foreign package that defines the name (any of their seams will do).

A foreign use outside its package's seam modules fails, as does one inside them without a row, and a row that no use
in those modules needs any more.
"""

from __future__ import annotations

import ast
import functools
import sysconfig
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("lightning_ft", "lightning_ft_job", "lightning_ft_cli")
SITE = Path(sysconfig.get_paths()["purelib"])
# Each foreign package: the top-level names it is imported by, and its source folders.
FOREIGN = {
    "torch": (("torch",), ("torch",)),
    "torchft": (("torchft",), ("torchft",)),
    "lightning": (
        ("lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities"),
        ("lightning", "lightning_utilities"),
    ),
}


# The seam modules of each package: where its private names may be reached, with their rows in the first one's
# ``PRIVATE_USES``. Beside the one module of functions: subclasses of a foreign class, whose overrides and inherited
# attributes cannot be a call (torchft's Manager, HTTPTransport, ProcessGroupGloo; Lightning's DDPStrategy), and the
# version adapter of torchft's process-group API.
def _folder(*folders: str) -> tuple[str, ...]:
    return tuple(sorted(p.relative_to(REPO).as_posix() for f in folders for p in (REPO / f).glob("*.py")))


# Where each package's private names may be reached; the first module holds the PRIVATE_USES inventory. torchft's
# seam is two folders (docs/architecture.md): every module there, and no module elsewhere, whatever it subclasses.
# Lightning's is its inventory and the strategy, whose private hook overrides can only sit in the subclass itself.
SEAMS = {
    "torch": ("lightning_ft/torch_internals.py", "lightning_ft/manager/listeners.py"),
    "torchft": (
        "lightning_ft/manager/internals.py",
        *(m for m in _folder("lightning_ft/manager", "lightning_ft/process_group") if not m.endswith("internals.py")),
    ),
    "lightning": ("lightning_ft/lightning_internals.py", "lightning_ft/strategy.py"),
}
# The project's own uses of a name that a foreign package defines too, reached on an object the guard cannot place:
# (module, name) -> what the object is.
PROJECT_OWN: dict[tuple[str, str], str] = {}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


@dataclass
class Index:
    """Private names defined in a set of sources: by package, and by class (its members and its bases' names)."""

    names: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # name -> packages
    members: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # class -> private members
    bases: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # class -> base class names
    packages: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # class -> packages

    def add_source(self, source: str, package: str) -> None:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                self.packages[node.name].add(package)
                self.bases[node.name] |= {ast.unparse(base).split(".")[-1] for base in node.bases}
                for inner in ast.walk(node):
                    for name in defined_names(inner):
                        self.members[node.name].add(name)
            for name in defined_names(node):
                self.names[name].add(package)

    def tables(self) -> tuple[dict[str, set[str]], ...]:
        return self.names, self.members, self.bases, self.packages

    def ancestors(self, cls: str) -> set[str]:
        seen: set[str] = set()
        todo = [cls]
        while todo:
            current = todo.pop()
            for base in self.bases.get(current, ()):
                if base not in seen:
                    seen.add(base)
                    todo.append(base)
        return seen


def defined_names(node: ast.AST) -> list[str]:
    """The private names ``node`` defines: a ``def``, a ``class``, an assigned name or attribute, an import alias."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        names = [node.name]
    elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = []
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Name):
                    names.append(part.id)
                elif isinstance(part, ast.Attribute) and isinstance(part.ctx, ast.Store):
                    names.append(part.attr)
    elif isinstance(node, ast.Import | ast.ImportFrom):
        names = [alias.asname for alias in node.names if alias.asname]
    else:
        return []
    return [name for name in names if is_private(name)]


def project_files() -> dict[str, Path]:
    return {
        path.relative_to(REPO).as_posix(): path
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
    }


def torch_sources() -> set[Path]:
    """The part of torch the project imports from (all of torch, 2,285 files, takes 20-30 s to parse): for each module
    the project imports below ``torch`` (``torch.distributed.fsdp``), its package's sources, and the modules beside it
    and beside each of its parents (``torch/distributed/*.py``, ``torch/*.py``); and the stubs of the C extension
    (``torch/_C/*.pyi``)."""
    imported = {
        name
        for path in project_files().values()
        for node in ast.walk(ast.parse(path.read_text()))
        for name in (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and not node.level
            else []
        )
        if name.split(".")[0] == "torch"
    }
    sources = set((SITE / "torch" / "_C").rglob("*.pyi"))  # the C extension's names, declared in its stubs
    for name in imported:
        parts = name.split(".")
        if len(parts) > 1 and (SITE.joinpath(*parts) / "__init__.py").is_file():
            sources.update(SITE.joinpath(*parts).rglob("*.py"))
        for depth in range(1, len(parts) + 1):
            sources.update(SITE.joinpath(*parts[:depth]).glob("*.py"))
    return sources


@functools.cache
def foreign_index() -> tuple[Index, float]:
    """The private names of the installed torch (the part the project imports from), torchft and Lightning sources,
    and the seconds it took to parse them (once per test session)."""
    start = time.perf_counter()
    index = Index()
    for package, (_, folders) in FOREIGN.items():
        if package == "torch":
            paths = sorted(torch_sources())
        else:
            paths = sorted(path for folder in folders for path in (SITE / folder).rglob("*.py"))
        for path in paths:
            if path.name.endswith("_test.py") or path.name.startswith("test_"):
                continue  # a package's own tests (torchft ships them beside its modules): not its names
            index.add_source(path.read_text(errors="replace"), package)
    return index, time.perf_counter() - start


@functools.cache
def project_index() -> Index:
    index = Index()
    for path in project_files().values():
        index.add_source(path.read_text(), "project")
    return index


def package_of(module: str) -> str | None:
    top = module.split(".")[0]
    if top in PACKAGES:
        return "project"
    return next((package for package, (tops, _) in FOREIGN.items() if top in tops), None)


@dataclass(frozen=True)
class Use:
    module: str
    line: int
    name: str
    packages: tuple[str, ...]  # the foreign packages it may belong to
    code: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.code} ({'/'.join(self.packages)} {self.name})"


class Finder(ast.NodeVisitor):
    """The foreign private uses of one module."""

    def __init__(self, module: str, foreign: Index, own: Index) -> None:
        self.module, self.foreign, self.own = module, foreign, own
        self.imported: dict[str, str] = {}  # local name -> the dotted name it was imported as
        self.constants: dict[str, str] = {}  # module-level string constants
        self.classes: list[ast.ClassDef] = []
        self.uses: list[Use] = []

    def run(self, tree: ast.Module) -> list[Use]:
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                self.constants.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
        for part in ast.walk(tree):
            if isinstance(part, ast.Import):
                for alias in part.names:
                    self.imported[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
            elif isinstance(part, ast.ImportFrom) and not part.level:
                for alias in part.names:
                    self.imported[alias.asname or alias.name] = f"{part.module}.{alias.name}"
        self.visit(tree)
        return self.uses

    def report(self, node: ast.AST, name: str, packages: set[str], code: str) -> None:
        if (self.module, name) not in PROJECT_OWN:
            self.uses.append(Use(self.module, getattr(node, "lineno", 0), name, tuple(sorted(packages)), code))

    def foreign_packages(self, base: ast.expr, name: str) -> set[str]:
        """The foreign packages ``base.name`` may reach into (none: the project's own, or not torch's, torchft's or
        Lightning's)."""
        root = base
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in self.imported:
            package = package_of(self.imported[root.id])
            if package == "project":
                return set() if name in self.own.names else set(self.foreign.names.get(name, ()))
            return {package} if package else set()  # any private name of a foreign module or class
        defined = self.foreign.names.get(name, set())
        if not defined:
            return set()
        if isinstance(base, ast.Name) and base.id in ("self", "cls") and self.classes:
            cls = self.classes[-1].name
            inherited = self.inherited(cls, name)
            if inherited:
                return inherited
            own_classes = {cls} | {c for c in self.own.ancestors(cls) if c in self.own.packages}
            if any(name in self.own.members.get(c, ()) for c in own_classes):
                return set()
        return set(defined)

    def inherited(self, cls: str, name: str) -> set[str]:
        """The foreign packages whose classes, among the foreign ancestors of the project's class ``cls``, define
        ``name``."""
        foreign_bases = {base for base in self.own.ancestors(cls) if base not in self.own.packages}
        ancestors = foreign_bases | {a for base in foreign_bases for a in self.foreign.ancestors(base)}
        return {
            package
            for c in ancestors
            if name in self.foreign.members.get(c, ())
            for package in self.foreign.packages.get(c, ())
        }

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node)
        for item in node.body:
            if not isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) or not is_private(item.name):
                continue
            if packages := self.inherited(node.name, item.name):
                self.report(item, item.name, packages, f"def {item.name} (override)")
        self.generic_visit(node)
        self.classes.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if is_private(node.attr) and (packages := self.foreign_packages(node.value, node.attr)):
            self.report(node, node.attr, packages, ast.unparse(node))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (
            isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
        ):
            arg = node.args[1]
            name = arg.value if isinstance(arg, ast.Constant) else self.constants.get(getattr(arg, "id", ""))
            if isinstance(name, str) and is_private(name) and (packages := self.foreign_packages(node.args[0], name)):
                self.report(node, name, packages, ast.unparse(node))
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.check_module(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module:
            return
        self.check_module(node, node.module)
        if (package := package_of(node.module)) and package != "project":
            for alias in node.names:
                if is_private(alias.name):
                    self.report(node, alias.name, {package}, f"from {node.module} import {alias.name}")

    def check_module(self, node: ast.AST, module: str) -> None:
        package = package_of(module)
        if package and package != "project":
            for part in module.split(".")[1:]:
                if is_private(part):
                    self.report(node, part, {package}, f"import {module}")


def foreign_uses(source: str, module: str = "snippet.py") -> list[Use]:
    """The foreign private uses of one module's source."""
    own = project_index()
    if module not in project_files():  # a snippet: its classes are the project's own too
        own = Index(*(defaultdict(set, {k: set(v) for k, v in table.items()}) for table in own.tables()))
        own.add_source(source, "project")
    return Finder(module, foreign_index()[0], own).run(ast.parse(source))


def all_foreign_uses() -> list[Use]:
    return [use for module, path in project_files().items() for use in foreign_uses(path.read_text(), module)]


def inventory(package: str) -> dict[str, str]:
    """The ``PRIVATE_USES`` rows of a package's first seam module, read from its syntax."""
    tree = ast.parse((REPO / SEAMS[package][0]).read_text())
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "PRIVATE_USES" and node.value is not None:  # type: ignore[attr-defined]
            rows: dict[str, str] = ast.literal_eval(node.value)  # type: ignore[attr-defined]
            return rows
    raise AssertionError(f"{SEAMS[package][0]} has no PRIVATE_USES")


def misplaced(uses: list[Use]) -> list[str]:
    """Each use outside its package's seam modules, or inside them without a row."""
    rows = {package: inventory(package) for package in SEAMS}
    wrong = []
    for use in uses:
        seams = [package for package in use.packages if use.module in SEAMS[package]]
        if not seams:
            wrong.append(f"{use}: outside the seam ({', '.join(s for p in use.packages for s in SEAMS[p][:1])})")
        elif not any(use.name in rows[package] for package in seams):
            wrong.append(f"{use}: no row in PRIVATE_USES ({', '.join(SEAMS[p][0] for p in seams)})")
    return wrong


def test_every_foreign_private_name_is_reached_in_its_seam_with_a_row():
    wrong = misplaced(all_foreign_uses())
    assert not wrong, "\n".join(wrong)


def named_in_seams(package: str) -> set[str]:
    """The private names a package's seam modules name (an attribute, a ``def``, a string or an imported name), outside
    their ``PRIVATE_USES`` table. What the guard finds depends on the installed version (torchft 0.2 defines no
    ``_handle_id``, its client's ``_quorum`` is Rust): a row for a name the seam's code names is still needed."""
    names: set[str] = set()
    for module in SEAMS[package]:
        tree = ast.parse((REPO / module).read_text())
        table = [
            node
            for node in tree.body
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "PRIVATE_USES" for t in node.targets)
        ]
        skipped = {id(inner) for node in table for inner in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
            elif isinstance(node, ast.alias):
                names.update(node.name.split("."))
    return {name for name in names if is_private(name)}


def test_every_inventory_row_is_still_used():
    uses = all_foreign_uses()
    for package in SEAMS:
        used = {use.name for use in uses if package in use.packages and use.module in SEAMS[package]}
        used |= named_in_seams(package)
        assert sorted(set(inventory(package)) - used) == [], f"rows of {SEAMS[package][0]} no code needs"


def test_the_foreign_index_takes_seconds():
    """Parsing torch (the part the project imports from), torchft and Lightning: ~5 s on one core, once a session."""
    index, seconds = foreign_index()
    assert {"_quorum_future", "_register_ddp_hooks", "_foreach_copy_"} <= set(index.names)
    assert seconds < 60, f"the foreign index took {seconds:.1f} s"


LEAKS = {
    "torchft DiLoCo": ("self._diloco._save_parameters()\n", "_save_parameters"),
    "torchft HTTPTransport override": (
        "from torchft.checkpointing import HTTPTransport\n"
        "class T(HTTPTransport):\n    def _serve(self):\n        self._server.serve_forever()\n",
        "_serve",
    ),
    "torchft HTTPTransport attribute": (
        "from torchft.checkpointing import HTTPTransport\nclass T(HTTPTransport):\n    def stop(self):\n"
        "        self._thread.join()\n",
        "_thread",
    ),
    "Lightning combined loader": ("combined_loader._load_state_dicts(states)\n", "_load_state_dicts"),
    "Lightning sampler wrapper": ("sampler = sampler.dataset._sampler\n", "_sampler"),
    "Lightning optimizer": ('optimizer = getattr(optimizer, "_optimizer", optimizer)\n', "_optimizer"),
    "Lightning override": (
        "from lightning.pytorch.strategies import DDPStrategy\n"
        "class S(DDPStrategy):\n    def _register_ddp_hooks(self):\n        pass\n",
        "_register_ddp_hooks",
    ),
    "Lightning inherited attribute": (
        "from lightning.pytorch.strategies import DDPStrategy\n"
        "class S(DDPStrategy):\n    def kwargs(self):\n        return self._ddp_kwargs\n",
        "_ddp_kwargs",
    ),
    "Lightning private import": ("from lightning.pytorch.loops.fetchers import _DataFetcher\n", "_DataFetcher"),
    "torch C extension": (
        'import torch\nhasattr(torch._C._distributed_c10d, "_reset_fr_recording_nccl")\n',
        "_distributed_c10d",
    ),
    "torch private module": ("from torch.distributed._serialization import _PseudoZipFile\n", "_serialization"),
    "torch op": ("import torch\ntorch._foreach_copy_(a, b)\n", "_foreach_copy_"),
}


@pytest.mark.parametrize("source, name", LEAKS.values(), ids=list(LEAKS))
def test_the_guard_reports_each_shape_of_leak(source, name):
    uses = foreign_uses(source, "lightning_ft/leak.py")
    assert name in {use.name for use in uses}, uses
    assert misplaced(uses), "a leak outside the seams passes"


def test_the_guard_leaves_the_projects_own_and_the_standard_librarys_private_names():
    source = (
        "import os, sys\nos._exit(0)\nsys._getframe()\n"
        "class Own:\n    def __init__(self):\n        self._step = 0\n"
        "    def _serve(self):\n        return self._step\n"
    )
    assert foreign_uses(source, "lightning_ft/own.py") == []


def test_lightning_calls_the_step_scheduler_update_where_loop_patches_settles_the_step():
    """``loop_patches.settle_each_step`` wraps the epoch loop's ``update_lr_schedulers`` and ends the step on its
    ``("step", update_plateau_schedulers=False)`` call, assuming that Lightning's ``_TrainingEpochLoop.advance``
    makes that call once a batch, unconditionally (a statement of the method's body), after the batch's optimizer
    step (``automatic_optimization.run`` / ``manual_optimization.run``) and before any ``on_train_batch_end`` hook
    (callbacks' and the module's); and that ``update_lr_schedulers`` takes ``(interval, update_plateau_schedulers)``.
    """
    import inspect

    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    assert list(inspect.signature(_TrainingEpochLoop.update_lr_schedulers).parameters) == [
        "self",
        "interval",
        "update_plateau_schedulers",
    ]
    tree = ast.parse(inspect.getsource(_TrainingEpochLoop))
    advance = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "advance")

    def is_step_update(call: ast.AST) -> bool:
        return (
            isinstance(call, ast.Call)
            and ast.unparse(call.func) == "self.update_lr_schedulers"
            and [ast.unparse(a) for a in call.args] == ["'step'"]
            and [(k.arg, ast.unparse(k.value)) for k in call.keywords] == [("update_plateau_schedulers", "False")]
        )

    updates = [node for node in ast.walk(advance) if is_step_update(node)]
    assert len(updates) == 1, "update_lr_schedulers('step', update_plateau_schedulers=False) is not called once"
    assert any(isinstance(s, ast.Expr) and is_step_update(s.value) for s in advance.body), "the call is conditional"
    calls = [node for node in ast.walk(advance) if isinstance(node, ast.Call)]
    steps = [c.lineno for c in calls if ast.unparse(c.func).endswith("_optimization.run")]
    batch_ends = [c.lineno for c in calls if any(ast.unparse(a) == "'on_train_batch_end'" for a in c.args)]
    assert len(steps) == 2 and len(batch_ends) == 2, (steps, batch_ends)
    assert max(steps) < updates[0].lineno < min(batch_ends)
