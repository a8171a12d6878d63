"""The shape of the package, as contracts: the layers import only downwards and only the libraries README's layout
table gives them, the core runs without torch or transformers, other libraries' private names are touched in
runtime/compat alone, no module assigns attributes of an object it does not own, following `AdaptiveBatch.attach`
enters no module of the wiring more than three times, and no test writes into the source tree. Each rule has a test
that plants a violation, in memory, and shows the rule sees it."""

import ast
import builtins
import collections
import functools
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import adaptive_batch

PACKAGE = Path(adaptive_batch.__file__).parent
# lowest first: a module may import from its own layer and the ones before it
LAYERS = ("core", "runtime", "probe", "hf", "cli")
COMPAT = PACKAGE / "runtime" / "compat.py"


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def layer_of(path: Path) -> int:
    """The layer of a module; the package's `__init__` and `testing.py` stand above all layers."""
    parts = path.relative_to(PACKAGE).parts
    return LAYERS.index(parts[0]) if len(parts) > 1 else len(LAYERS)


def in_compat(path: Path) -> bool:
    """Whether a module is runtime/compat (one module, or a package of them)."""
    return path == COMPAT or COMPAT in path.parents


def imported_modules(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a module, at any depth (lazy imports count); `source`: the
    module's text where it is not the file's (a planted violation)."""
    package = ".".join(("adaptive_batch", *path.relative_to(PACKAGE).parts[:-1]))
    found = []
    for node in ast.walk(ast.parse(source if source is not None else path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module
            # `from . import status` imports a module too
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names] + [(node.lineno, name)]
    return found


def package_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "adaptive_batch" or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return LAYERS.index(parts[1])


def test_every_layer_imports_only_its_own_and_the_layers_below():
    upward = []
    for path in modules():
        own = layer_of(path)
        for line, module in imported_modules(path):
            layer = package_layer(module)
            if layer is not None and layer > own:
                upward.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert upward == []


def test_the_contract_sees_an_upward_import():
    # the check above, on a module of the core that imports the Trainer wiring (its text in memory, no file)
    bad = PACKAGE / "core" / "_contract_probe.py"
    imported = imported_modules(bad, "from ..hf import session\n")
    assert package_layer(imported[0][1]) == LAYERS.index("hf") > layer_of(bad)


BLOCKED = ("torch", "transformers", "accelerate", "datasets", "peft", "trl", "numpy")


def test_the_core_imports_without_torch_or_transformers():
    core = sorted(path.stem for path in (PACKAGE / "core").glob("*.py") if path.stem != "__init__")
    script = f"""
import importlib, importlib.abc, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"the core imported {{name}}")

sys.meta_path.insert(0, Blocked())
for name in {core!r}:
    importlib.import_module("adaptive_batch.core." + name)
import adaptive_batch  # the package's top level exposes the core only, and the callback lazily
print(len({core!r}))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == len(core) >= 10


def own_private_names() -> set[str]:
    """The names starting with one underscore that the package defines itself (functions, classes, attributes,
    parameters, module globals), outside compat (whose overrides carry other libraries' names)."""
    names = set()
    for path in modules():
        if path == COMPAT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def foreign_private_names(path: Path, own: set[str]) -> list[str]:
    """Other libraries' private names a module touches: `x._name`, `getattr(x, "_name")` and the like, a string
    `"_name"`, an import from a private module."""
    found = []

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__") and name not in own

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and private(node.attr):
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            if private(node.value):
                found.append(f"{node.lineno}: {node.value!r}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [alias.name for alias in node.names] + [getattr(node, "module", None) or ""]
            for name in names:
                if any(private(part) for part in name.split(".")):
                    found.append(f"{node.lineno}: import {name}")
    return found


def test_other_libraries_private_names_are_touched_in_compat_alone():
    own = own_private_names()
    outside = {
        str(path.relative_to(PACKAGE)): names
        for path in modules()
        if path != COMPAT and (names := foreign_private_names(path, own))
    }
    assert outside == {}
    assert foreign_private_names(COMPAT, own)  # compat does touch them: the check sees what it looks for


def test_the_session_imports_few_of_the_package_s_modules():
    # the parts own their jobs (hf/assemble, growth, resume, dataloader, status): the session only holds them
    session = PACKAGE / "hf" / "session.py"
    imported = {
        ".".join(module.split(".")[:3])
        for _, module in imported_modules(session)
        if package_layer(module) is not None and len(module.split(".")) >= 3
    }
    assert len(imported) <= 10, sorted(imported)


# transformers hands a callback the loop's TrainerState and TrainerControl to change: the channel by which a
# callback steers the loop (`state.epoch`, `control.should_save`, the Trainer's `state.max_steps`)
STEERED = {"state", "control"}
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def own_nodes(scope: ast.AST):
    """The nodes of a module, class or function, without the insides of the functions and classes it defines."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (*DEFINITIONS, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def made_targets(scope: ast.AST) -> list[ast.expr]:
    """What a scope binds to objects made there: `a = f()`, `a, self.b = f()`, `a = f() if c else None`."""

    def made(value: ast.expr) -> bool:
        if isinstance(value, ast.IfExp):
            return all(made(branch) or ast.unparse(branch) == "None" for branch in (value.body, value.orelse))
        return isinstance(value, ast.Call)

    found = []
    for node in own_nodes(scope):
        if isinstance(node, ast.Assign) and made(node.value):
            for target in node.targets:
                found += target.elts if isinstance(target, ast.Tuple) else [target]
    return found


def attribute_writes(scope: ast.AST):
    """(owner, attribute, line) of each attribute a scope assigns: `owner.attribute = ...` (also augmented, or in a
    tuple), or `setattr(owner, "attribute", ...)`."""
    for node in own_nodes(scope):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and len(node.args) >= 2:
            name = node.args[1].value if isinstance(node.args[1], ast.Constant) else "?"
            yield node.args[0], str(name), node.lineno
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and isinstance(part.ctx, ast.Store):
                    yield part.value, part.attr, part.lineno


def foreign_assignments(source: str) -> list[str]:
    """Where a module assigns an attribute of an object it does not own. `x.name = ...` is allowed only where `x` is
    `self` (or `cls`); an attribute of `self` that its class made (`self.runner = MicroBatchRunner(...)`: the maker
    wires what it made); a name the function, or one around it, bound to a new object; a class or function of the
    module; the TrainerState or TrainerControl transformers hands a callback to change ([`STEERED`]). Also allowed:
    an attribute a class of the module declares (install.py's mixin declares the Trainer's `_adaptive_batch`) and
    Python's metadata (`__doc__`)."""
    tree = ast.parse(source)
    declared = {
        node.target.id
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef)
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    found = []

    def owned(owner: ast.expr, name: str, selves: set, made: set, made_attributes: set) -> bool:
        if name.startswith("__") or name in declared:
            return True
        if isinstance(owner, ast.Name):
            return owner.id in selves | made | STEERED
        if isinstance(owner, ast.Attribute):  # one level below: what its class made, or the loop's state
            by_self = isinstance(owner.value, ast.Name) and owner.value.id in selves
            return owner.attr in STEERED or (by_self and owner.attr in made_attributes)
        return False

    def visit(scope: ast.AST, selves: set, made: set, made_attributes: set) -> None:
        made = made | {target.id for target in made_targets(scope) if isinstance(target, ast.Name)}
        made |= {node.name for node in ast.iter_child_nodes(scope) if isinstance(node, DEFINITIONS)}
        for owner, name, line in attribute_writes(scope):
            if not owned(owner, name, selves, made, made_attributes):
                found.append((line, f"{line}: {ast.unparse(owner)}.{name}"))
        for node in own_nodes(scope):
            if isinstance(node, ast.ClassDef):
                attributes = {
                    target.attr
                    for method in node.body
                    if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) and method.args.args
                    for target in made_targets(method)
                    if isinstance(target, ast.Attribute)
                    and ast.unparse(target.value) == method.args.args[0].arg
                }
                visit(node, selves, made, attributes)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                method = (
                    isinstance(scope, ast.ClassDef) and node.args.args
                )  # its first parameter is its object
                visit(node, selves | {node.args.args[0].arg} if method else selves, made, made_attributes)

    visit(tree, set(), set(), set())
    return [text for _, text in sorted(found)]


def test_the_trainer_wiring_assigns_only_attributes_of_objects_it_owns():
    # each part owns its state: a session's counters are set by the status, not by resume.py; the controller by
    # the assembly that made it, not by a function given the session
    outside = {
        path.name: found
        for path in sorted((PACKAGE / "hf").glob("*.py"))
        if (found := foreign_assignments(path.read_text()))
    }
    assert outside == {}


def test_the_ownership_check_sees_an_object_written_from_outside():
    planted = """
import contextlib


def restore(session, state):
    session.tokens_seen = state["tokens_seen"]  # 6: another object's counter
    session.runner.last.micro_batch_size += 1  # 7


class Growth:
    def __init__(self, runner):
        self.runner = runner  # given, not made
        self.timing = Timing()

    def grow(self, plan):
        self.runner.flatten = True  # 16: an object it was given
        self.timing.start = 0.0  # made by this class: allowed
        self.timing.clock.start = 0.0  # 18: inside what it made
        new = Plan()
        new.size = 2  # made here: allowed
        plan.size = 2  # 21
        setattr(plan, "size", 3)  # 22
        self.x, plan.y = 1, 2  # 23
        self.trainer.state.max_steps = 4  # allowed: the loop's state

        def inner():
            new.size, plan.size = 3, 4  # 27: `new` was made around it, `plan` was not

        return inner


class Declares:
    wired: int


def wire(trainer, control):
    trainer.wired = 1  # allowed: this module declares it
    control.should_save = True  # allowed: the loop's control
    Declares.__doc__ = "metadata"
"""
    found = [line.split(":")[0] for line in foreign_assignments(planted)]
    assert found == ["6", "7", "16", "18", "21", "22", "23", "27"], foreign_assignments(planted)
