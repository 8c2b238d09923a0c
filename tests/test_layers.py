"""The package's layers, as ``qcomm/__init__.py`` states them, checked on the source: every
import of every module (top-level or inside a function, absolute or relative) may reach only
its own layer or the layers below it, and nothing outside ``qcomm.testing`` imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import qcomm

ROOT = Path(qcomm.__file__).resolve().parent

# Bottom to top. A module belongs to the first entry its dotted name starts with.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("qcomm.validation", "qcomm.seeds")),
    # The bytes on a connection between sites (frames, the token's admission, encryption):
    # the links between nodes and the rendezvous's front both use them.
    ("wire", ("qcomm.wire",)),
    # Siblings above the foundation: the job's rendezvous and the kernels.
    ("rendezvous", ("qcomm.rendezvous",)),
    ("kernels", ("qcomm.kernels",)),
    ("compress", ("qcomm.compress",)),
    ("collectives", ("qcomm.collectives",)),
    ("engine", ("qcomm.engine",)),
    # Saves and loads what the optimizers above hold, without naming them (qcomm.sgd
    # re-exports its functions).
    ("checkpoint", ("qcomm.checkpoint",)),
    # Siblings at the top of the library: neither imports the other.
    ("sgd", ("qcomm.sgd",)),
    ("hooks", ("qcomm.hooks",)),
    # Integrations with training frameworks: on top of the optimizers.
    ("integrations", ("qcomm.integrations",)),
    ("testing", ("qcomm.testing",)),
]
RANK = {"foundation": 0, "wire": 1, "rendezvous": 2, "kernels": 2, "compress": 3,
        "collectives": 4, "engine": 5, "checkpoint": 6, "sgd": 7, "hooks": 7, "integrations": 8,
        "testing": 9}


def layer_of(module: str) -> str | None:
    for name, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    return None  # the package itself (qcomm/__init__.py)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every qcomm module ``path`` imports."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # "from qcomm.kernels import reference" imports qcomm.kernels.reference
            found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
            found.append((node.lineno, target))
    return [(line, m) for line, m in found if m == "qcomm" or m.startswith("qcomm.")]


MODULES = sorted(ROOT.rglob("*.py"))


def test_every_module_has_a_layer() -> None:
    orphans = [module_name(p) for p in MODULES
               if layer_of(module_name(p)) is None and module_name(p) != "qcomm"]
    assert not orphans, f"modules outside every layer of tests/test_layers.py: {orphans}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_only_reach_down(path: Path) -> None:
    me = layer_of(module_name(path))
    bad = []
    for line, target in imported_modules(path):
        if target == "qcomm":
            continue
        theirs = layer_of(target)
        if theirs is None:
            continue  # e.g. "qcomm.__version__"
        # The package's __init__ imports no layer (``import qcomm`` stays cheap); nothing but
        # testing imports testing; every other import reaches its own layer or a lower one.
        upward = me is None or (theirs == "testing" and me != "testing") or (
            theirs != me and RANK[theirs] >= RANK[me])
        if upward:
            bad.append((line, target))
    assert not bad, f"{module_name(path)} ({me}) imports upwards or sideways: {bad}"


def test_the_package_docstring_states_these_layers() -> None:
    doc = qcomm.__doc__
    positions = [doc.index(p) for _, prefixes in LAYERS for p in prefixes]
    # Listed top to bottom in the docstring: the reverse of LAYERS.
    assert positions == sorted(positions, reverse=True), doc
