"""The shape of the package, as contracts: the layers import only downwards and only the libraries README's layout
table gives them, the core runs without torch or transformers, other libraries' private names are touched in
runtime/compat alone, no module assigns attributes of an object it does not own, following `AdaptiveBatch.attach`
enters no module of the wiring more than three times, and no test writes into the source tree. Each rule has a test
that plants a violation, in memory, and shows the rule sees it."""

import ast
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
COMPAT = PACKAGE / "runtime" / "compat"  # a package: one module a library


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def layer_of(path: Path) -> int:
    """The layer of a module; the package's `__init__` and `testing.py` stand above all layers."""
    parts = path.relative_to(PACKAGE).parts
    return LAYERS.index(parts[0]) if len(parts) > 1 else len(LAYERS)


def in_compat(path: Path) -> bool:
    """Whether a module is one of runtime/compat's."""
    return COMPAT in path.parents


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


def core_import_failure(modules: list[str], planted: str | None = None) -> str | None:
    """In a fresh interpreter that cannot import torch, transformers and the like: import the core's `modules`
    (and run `planted`, a module's text, as one more). The error, or `None` where all imported."""
    script = f"""
import importlib, importlib.abc, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"the core imported {{name}}")

sys.meta_path.insert(0, Blocked())
for name in {modules!r}:
    importlib.import_module("adaptive_batch.core." + name)
import adaptive_batch  # the package's top level exposes the core only, and the callback lazily
exec({planted or ""!r})
print(len({modules!r}))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    return None if result.returncode == 0 and int(result.stdout) == len(modules) else result.stderr


def test_the_core_imports_without_torch_or_transformers():
    core = sorted(path.stem for path in (PACKAGE / "core").glob("*.py") if path.stem != "__init__")
    assert len(core) >= 10
    assert core_import_failure(core) is None


def test_the_core_import_check_sees_a_module_that_imports_torch():
    assert "the core imported torch" in core_import_failure(["config"], "import torch.nn\n")


# README's layout table, its "imports" column: the other libraries each layer imports (and those of the layers below)
LIBRARIES = {
    "core": {"numpy"},  # "Python only"; numpy: issue 35 item 5 lets the fits use it (a declared dependency)
    "runtime": {"torch"},
    "probe": set(),
    "hf": {"transformers"},
    "cli": set(),
}
# where the code goes beyond the table: each a lazy import in one module, for one job
BEYOND_THE_TABLE = {
    # each library's private touches, one module a library (compat/accelerate.py, deepspeed.py and torch.py import
    # nothing beyond the table: they work on the objects handed to them)
    "runtime/compat/trainer.py": {"transformers"},  # the Trainer being built, its collator, its dataset
    "runtime/compat/trl.py": {"trl"},  # SFTTrainer's dataset preparation
    "runtime/engines.py": {"deepspeed", "packaging"},  # the DeepSpeed engine and its version check
    "runtime/lengths.py": {"datasets", "pyarrow"},  # a `datasets.Dataset`'s lengths from its Arrow column
    "probe/cache.py": {"transformers"},  # the setup a cached probe result is for: transformers' version, args
    "probe/load.py": {"transformers", "peft"},  # loading the model as a (Q)LoRA run would
    "probe/trials.py": {"transformers"},  # a trial step through the Trainer
    "cli/dataset_facts.py": {"trl", "datasets"},  # an SFT dataset as TRL prepares it
    "cli/sft_args.py": {"trl"},  # SFTConfig's fields
    "cli/figure.py": {"matplotlib"},  # `adaptive-batch plot`
    "cli/plan.py": {"rich"},  # the plan's table in a terminal
    "cli/probe.py": {"rich"},  # the probe's progress
    "testing.py": {"tokenizers"},  # (above the layers) a tokenizer trained on the spot
}


def libraries_allowed(path: Path) -> set[str]:
    relative, allowed = path.relative_to(PACKAGE).as_posix(), set()
    for layer in LAYERS[: layer_of(path) + 1]:
        allowed |= LIBRARIES[layer]
    for where, libraries in BEYOND_THE_TABLE.items():
        if relative == where or relative.startswith(where + "/") or relative == where + ".py":
            allowed |= libraries
    return allowed


def libraries_beyond_the_table(path: Path, source: str | None = None) -> list[str]:
    """The imports of other libraries (not Python's own) that the table does not give the module's layer."""
    allowed = libraries_allowed(path)
    return [
        f"{line}: {module}"
        for line, module in imported_modules(path, source)
        if module.split(".")[0] not in sys.stdlib_module_names | {"adaptive_batch"} | allowed
    ]


def test_every_layer_imports_the_libraries_readme_gives_it():
    beyond = {
        str(path.relative_to(PACKAGE)): found
        for path in modules()
        if (found := libraries_beyond_the_table(path))
    }
    assert beyond == {}


def test_the_library_check_sees_torch_in_the_core_and_transformers_in_the_runtime():
    assert libraries_beyond_the_table(PACKAGE / "core" / "_probe.py", "import torch.nn\n") == ["1: torch.nn"]
    runtime = PACKAGE / "runtime" / "_probe.py"
    assert libraries_beyond_the_table(runtime, "import torch\nfrom transformers import Trainer\n") == [
        "2: transformers.Trainer",
        "2: transformers",
    ]
    assert (
        libraries_beyond_the_table(PACKAGE / "hf" / "_probe.py", "import transformers, torch, json\n") == []
    )


# the libraries whose private names are touched in runtime/compat alone
OTHER_LIBRARIES = ("transformers", "accelerate", "torch", "trl", "deepspeed", "peft", "datasets", "argparse")


def own_private_names() -> set[str]:
    """The names starting with one underscore that the package defines itself (functions, classes, attributes,
    parameters, module globals), outside compat (whose overrides carry other libraries' names)."""
    names = set()
    for path in modules():
        if in_compat(path):
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


def dotted(node: ast.expr) -> str | None:
    """`a.b.c` as text, where the expression is a chain of names."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def other_libraries_imports(tree: ast.AST) -> dict[str, str]:
    """What each name bound by an import of another library stands for: `argparse` -> `argparse`, `Trainer` ->
    `transformers.Trainer`."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names |= {alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names}
    return {name: target for name, target in names.items() if target.split(".")[0] in OTHER_LIBRARIES}


def names_defined_by(name: str) -> set[str] | None:
    """The attributes of another library's object named `name` (`argparse.HelpFormatter`): where its private
    names live. `None` where it cannot be imported here: then any private name reached through it counts."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for part in parts[end:]:
            found = getattr(found, part, None)
        return set(dir(found)) if found is not None else None
    return None


def foreign_private_names(path: Path, own: set[str], source: str | None = None) -> list[str]:
    """Other libraries' private names a module touches: by spelling, a `_name` the package does not define
    (`x._name`, `getattr(x, "_name")`, a string `"_name"`, an import from a private module); by where it is defined,
    a `_name` reached through another library's module or object (`torch._dynamo`), or overridden or called by a
    class deriving from another library's class that defines it (`def _get_help_string` in a subclass of an
    argparse formatter, `super()._get_help_string(...)`), even where the package defines the same spelling."""
    tree = ast.parse(source if source is not None else path.read_text())
    imports, found = other_libraries_imports(tree), set()

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    def through_import(node: ast.expr) -> bool:
        text = dotted(node)
        return text is not None and text.split(".")[0] in imports

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            if node.attr not in own or through_import(node.value):
                found.add((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            if private(node.value) and node.value not in own:
                found.add((node.lineno, repr(node.value)))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [alias.name for alias in node.names] + [getattr(node, "module", None) or ""]
            for name in names:
                if any(private(part) and part not in own for part in name.split(".")):
                    found.add((node.lineno, f"import {name}"))
        elif isinstance(node, ast.ClassDef):
            inherited: set[str] = set()
            for base in node.bases:
                if through_import(base):
                    root, *rest = dotted(base).split(".")
                    defined = names_defined_by(".".join([imports[root], *rest]))
                    inherited |= defined if defined is not None else {"*"}
            if not inherited:
                continue
            for inner in ast.walk(node):
                name = inner.name if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
                if isinstance(inner, ast.Attribute) and (
                    isinstance(inner.value, ast.Call)
                    and ast.unparse(inner.value.func) == "super"
                    or ast.unparse(inner.value) in ("self", "cls")
                ):
                    name = inner.attr
                if name is not None and private(name) and (name in inherited or "*" in inherited):
                    what = f"def {name}" if not isinstance(inner, ast.Attribute) else f".{name}"
                    found.add((inner.lineno, what))
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_other_libraries_private_names_are_touched_in_compat_alone():
    own = own_private_names()
    outside = {
        path.relative_to(PACKAGE).as_posix(): found
        for path in modules()
        if not in_compat(path) and (found := foreign_private_names(path, own))
    }
    assert outside == {}
    # compat does touch them: the check sees what it looks for
    assert any(foreign_private_names(path, own) for path in modules() if in_compat(path))


def test_the_private_name_check_sees_other_libraries_names_by_where_they_are_defined():
    planted = """
import argparse
import torch


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # 7: argparse's
        return super()._get_help_string(action) + self._mine()  # 8: argparse's; ours

    def _mine(self):
        return ""


def clean(trainer, options):
    torch._dynamo.reset()  # 15: through torch
    trainer._memory_tracker.stop()  # 16: a name the package does not define
    return getattr(options, "_unknown", None), options._mine  # 17: by spelling; ours
"""
    # the package defines each spelling: only where it is defined tells
    own = {"_get_help_string", "_mine", "_dynamo"}
    found = foreign_private_names(PACKAGE / "cli" / "_probe.py", own, planted)
    assert found == [
        "7: def _get_help_string",
        "8: ._get_help_string",
        "15: ._dynamo",
        "16: ._memory_tracker",
        "17: '_unknown'",
    ]


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
    # the assembly that made it, not by a function given the session. (hf/ only: below it, code sets what torch and
    # transformers leave to the caller to set, `param.grad = None`, `model.config.use_cache = False`, and compat's
    # reach into other libraries' objects is its job)
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


ENTERED_AT_MOST = 3


def module_entries(call) -> collections.Counter:
    """How often running `call()` enters each of the package's modules (as "hf/session.py"): a function, method or
    class of the module called from code outside it (the nearest caller in the package, or outside the package). A
    property read is an attribute read and is not counted."""
    root, entries = str(PACKAGE) + "/", collections.Counter()

    def property_read(frame) -> bool:
        owner = frame.f_locals.get("self")
        found = inspect.getattr_static(type(owner), frame.f_code.co_name, None) if owner is not None else None
        getter = getattr(found, "fget", None) or getattr(found, "func", None)
        is_property = isinstance(found, (property, functools.cached_property))
        return is_property and getattr(getter, "__code__", None) is frame.f_code

    def profile(frame, event, arg) -> None:
        where = frame.f_code.co_filename
        if event != "call" or not where.startswith(root) or property_read(frame):
            return
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(root):
            caller = caller.f_back
        if caller is None or caller.f_code.co_filename != where:
            entries[where[len(root) :]] += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entries


def test_following_attach_enters_no_module_of_the_wiring_more_than_three_times(make_trainer):
    from adaptive_batch import AdaptiveBatch

    trainer = make_trainer()
    entries = module_entries(lambda: AdaptiveBatch.attach(trainer))
    assert entries["hf/session.py"] >= 1  # (the count sees the wiring)
    assert {
        module: n for module, n in entries.items() if module.startswith("hf/") and n > ENTERED_AT_MOST
    } == {}


def test_the_entry_count_sees_a_module_entered_four_times():
    def planted(name: str, source: str) -> dict:
        scope: dict = {}
        exec(compile(source, str(PACKAGE / "hf" / name), "exec"), scope)  # (compiled in memory, no file)
        return scope

    parts = planted("_parts.py", "def part(x):\n    return x + 1\n")
    wiring = planted("_wiring.py", "def wire(part):\n    return [part(i) for i in range(4)]\n")
    entries = module_entries(lambda: wiring["wire"](parts["part"]))
    assert entries["hf/_parts.py"] == 4 > ENTERED_AT_MOST


TESTS = Path(__file__).resolve().parent
WRITES = {"write_text", "write_bytes", "touch", "mkdir", "symlink_to", "rename", "copy", "copy2"}


def source_tree_writes(source: str) -> list[str]:
    """Where a test writes into the source tree: a write (`write_text`, `write_bytes`, `touch`, `mkdir`, `open` to
    write, a `shutil` copy or move) to a path made from `PACKAGE` or a `__file__`, directly or through names bound
    to such a path (at any depth of the module)."""
    tree = ast.parse(source)
    tainted = {"PACKAGE", "__file__"}

    def from_tree(node: ast.AST) -> bool:
        return any(
            isinstance(part, ast.Name) and part.id in tainted or getattr(part, "attr", None) == "__file__"
            for part in ast.walk(node)
        )

    # (what is bound, where it comes from) by an assignment, a `for` and a `with ... as`
    binds = {
        ast.Assign: ("targets", "value"),
        ast.For: ("target", "iter"),
        ast.withitem: ("optional_vars", "context_expr"),
    }
    for _ in range(10):  # names bound to such paths, and names bound to those
        for node in ast.walk(tree):
            if type(node) in binds and from_tree(getattr(node, binds[type(node)][1])):
                bound = getattr(node, binds[type(node)][0])
                for target in bound if isinstance(bound, list) else [bound]:
                    tainted |= (
                        {n.id for n in ast.walk(target) if isinstance(n, ast.Name)} if target else set()
                    )
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", getattr(node.func, "id", None))
        written = None
        if name in WRITES and isinstance(node.func, ast.Attribute) and name not in ("copy", "copy2"):
            written = node.func.value  # path.write_text(...)
        elif name in ("copy", "copy2", "copyfile", "copytree", "move") and len(node.args) >= 2:
            written = node.args[1]  # shutil.copy(source, target)
        elif name == "open" and node.args:
            mode = (
                node.args[1]
                if len(node.args) > 1
                else next((k.value for k in node.keywords if k.arg == "mode"), None)
            )
            if isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax+"):
                written = node.args[0]
        if written is not None and from_tree(written):
            found.append(f"{node.lineno}: {ast.unparse(node)[:60]}")
    return found


def test_no_test_writes_into_the_source_tree():
    found = {
        path.name: writes
        for path in sorted(TESTS.glob("*.py"))
        if (writes := source_tree_writes(path.read_text()))
    }
    assert found == {}


def test_the_source_tree_check_sees_a_test_writing_into_the_core():
    planted = """
def test_contract():
    bad = PACKAGE / "core" / "_contract_probe.py"
    bad.write_text("from ..hf import session")  # 4
    here = Path(__file__).parent
    with open(here / "out.json", "w") as handle:  # 6
        handle.write("{}")
    for folder in [PACKAGE / "hf"]:
        shutil.copy("a.py", folder / "a.py")  # 9
    (tmp_path / "fine.txt").write_text("a test's own folder")
    print(open(here / "README.md").read())  # reading: fine
"""
    assert [line.split(":")[0] for line in source_tree_writes(planted)] == ["4", "6", "9"]
