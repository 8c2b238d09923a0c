"""The shape of the source, checked on every ``.py`` file under ``qcomm/`` with :mod:`ast`:
module docstrings stay short (the long explanations live in ``docs/``; under ``bench/`` too,
where they live in its READMEs), functions stay short, and every ``docs/...md`` page a module
docstring names exists."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "qcomm"
MAX_MODULE_DOCSTRING_LINES = 30
MAX_FUNCTION_LINES = 80
MAX_GOSSIP_CLASS_LINES = 400
MAX_CLASS_LINES = 400
MAX_METHOD_LINES = 60
DOC_PATH = re.compile(r"docs/[\w/.-]+\.md")


@cache
def _modules() -> tuple[tuple[str, ast.Module], ...]:
    """Every module of the package, parsed once: (path relative to the repository, tree)."""
    return tuple((path.relative_to(REPO).as_posix(), ast.parse(path.read_text(), str(path)))
                 for path in sorted(PACKAGE.rglob("*.py")))


def _module_docstring(tree: ast.Module) -> ast.Expr | None:
    first = tree.body[0] if tree.body else None
    if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return first
    return None


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined, operator]


@cache
def _bench_modules() -> tuple[tuple[str, ast.Module], ...]:
    """Every module of the benchmarks (scripts and the cluster's package), parsed once."""
    return tuple((path.relative_to(REPO).as_posix(), ast.parse(path.read_text(), str(path)))
                 for path in sorted((REPO / "bench").rglob("*.py")))


def test_the_package_has_modules() -> None:
    assert len(_modules()) > 10, f"no modules found under {PACKAGE}"


def test_no_module_docstring_is_longer_than_30_lines() -> None:
    too_long = [f"{path}: module docstring of {_lines(doc)} lines"
                for path, tree in (*_modules(), *_bench_modules())
                if (doc := _module_docstring(tree)) and _lines(doc) > MAX_MODULE_DOCSTRING_LINES]
    assert not too_long, (f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (move the "
                          "long explanations to docs/):\n" + "\n".join(too_long))


def test_no_function_is_longer_than_80_lines() -> None:
    too_long = [f"{path}:{node.lineno}: {node.name} has {_lines(node)} lines"
                for path, tree in _modules() for node in ast.walk(tree)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and _lines(node) > MAX_FUNCTION_LINES]
    assert not too_long, (f"functions over {MAX_FUNCTION_LINES} lines:\n"
                          + "\n".join(too_long))


def test_every_docs_page_a_module_docstring_names_exists() -> None:
    missing = [f"{path}: names {page}, which does not exist"
               for path, tree in _modules() if (doc := _module_docstring(tree))
               for page in sorted(set(DOC_PATH.findall(doc.value.value)))  # type: ignore[attr-defined]
               if not (REPO / page).is_file()]
    assert not missing, "module docstrings name missing docs pages:\n" + "\n".join(missing)


def test_no_class_of_the_gossip_is_longer_than_400_lines() -> None:
    """The gossip's classes each hold one job (the wait-free one is the CHOCO state machine;
    its membership, inbox and books are classes of their own)."""
    too_long = [f"{path}: class {node.name} of {_lines(node)} lines"
                for path, tree in _modules() if path.startswith("qcomm/collectives/gossip/")
                for node in ast.walk(tree)
                if isinstance(node, ast.ClassDef) and _lines(node) > MAX_GOSSIP_CLASS_LINES]
    assert not too_long, (f"gossip classes over {MAX_GOSSIP_CLASS_LINES} lines:\n"
                          + "\n".join(too_long))


def test_no_class_is_longer_than_400_lines_and_no_method_than_60() -> None:
    """Anywhere in the package: a class that grows past 400 lines holds more than one job (the
    engine once held set-up, attachment, the step, joins, stats and state in 608), and a method
    past 60 lines is a function that wants its parts named."""
    classes = [f"{path}: class {node.name} of {_lines(node)} lines"
               for path, tree in _modules() for node in ast.walk(tree)
               if isinstance(node, ast.ClassDef) and _lines(node) > MAX_CLASS_LINES]
    methods = [f"{path}: {node.name}.{item.name} of {_lines(item)} lines"
               for path, tree in _modules() for node in ast.walk(tree)
               if isinstance(node, ast.ClassDef) for item in node.body
               if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
               and _lines(item) > MAX_METHOD_LINES]
    assert not classes + methods, (f"classes over {MAX_CLASS_LINES} lines or methods over "
                                   f"{MAX_METHOD_LINES}:\n" + "\n".join(classes + methods))
