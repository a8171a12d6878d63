"""The shape of the package, as contracts: the layers import only downwards, the core runs without torch or
transformers, and other libraries' private names are touched in `runtime/compat/` alone."""

import ast
import subprocess
import sys
from pathlib import Path

import adaptive_batch

PACKAGE = Path(adaptive_batch.__file__).parent
# lowest first: a module may import from its own layer and the ones before it
LAYERS = ("core", "runtime", "probe", "hf", "cli")
COMPAT = PACKAGE / "runtime" / "compat"


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def layer_of(path: Path) -> int:
    """The layer of a module; the package's `__init__` and `testing.py` stand above all layers."""
    parts = path.relative_to(PACKAGE).parts
    return LAYERS.index(parts[0]) if len(parts) > 1 else len(LAYERS)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a module, at any depth (lazy imports count)."""
    package = ".".join(("adaptive_batch", *path.relative_to(PACKAGE).parts[:-1]))
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
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


def test_the_contract_sees_an_upward_import(tmp_path):
    # the check above, on a module of the core that imports the Trainer wiring
    bad = PACKAGE / "core" / "_contract_probe.py"
    bad.write_text("from ..hf import session\n")
    try:
        assert package_layer(imported_modules(bad)[0][1]) == LAYERS.index("hf") > layer_of(bad)
    finally:
        bad.unlink()


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
        if COMPAT in path.parents:
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
        if COMPAT not in path.parents and (names := foreign_private_names(path, own))
    }
    assert outside == {}
    # compat does touch them: the check sees what it looks for
    assert any(foreign_private_names(path, own) for path in COMPAT.glob("*.py"))


def test_the_session_only_sequences():
    # what each job needs lives in a module of its own (hf/assemble, growth, resume, dataloader, status)
    session = PACKAGE / "hf" / "session.py"
    imported = {
        ".".join(module.split(".")[:3])
        for _, module in imported_modules(session)
        if package_layer(module) is not None and len(module.split(".")) >= 3
    }
    assert len(session.read_text().splitlines()) < 300
    assert len(imported) <= 10, sorted(imported)
