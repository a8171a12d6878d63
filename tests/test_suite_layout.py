"""The suite's own layout: what tests share lives in plain modules (helpers.py, launch.py), imported by name. Not in
conftest, which pytest loads as a plugin, and not in a test file: a test file imported by another can exist as two
modules under some of pytest's import modes, each with its own caches (launch.py keeps the reference runs)."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def forbidden(name: str) -> bool:
    top = name.split(".")[0]
    return top == "conftest" or top.startswith("test_")


def forbidden_imports(path: Path) -> list[str]:
    """Every `import`, `from ... import` and `importlib.import_module("...")` of conftest or a test_* module in
    `path`, as "file:line: name"."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):  # `from . import test_x` names the module among the aliases
            names = [node.module] if node.module else [alias.name for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        else:
            continue
        found += [(node.lineno, name) for name in names if forbidden(name)]
    return [f"{path.name}:{line}: {name}" for line, name in sorted(found)]


def test_no_test_file_imports_conftest_or_another_test_file():
    files = sorted(TESTS.glob("*.py"))
    assert TESTS / "conftest.py" in files and TESTS / "helpers.py" in files
    found = [line for path in files for line in forbidden_imports(path)]
    assert not found, (
        "tests/ imports conftest or a test file; move what is shared to tests/helpers.py (or launch.py for "
        "launching processes) and import it from there:\n" + "\n".join(found)
    )
