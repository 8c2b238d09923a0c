"""The release a user installs: ``python -m build`` makes an sdist and a wheel of the version
in ``qcomm/__init__.py`` holding every file of the package and nothing of ``tests/`` or
``bench/``; each installs into a fresh virtual environment, where the codec and one ASSGD step
run from the installed copy, not from this checkout.

The builds and installs run without build isolation and without an index (offline): the running
interpreter's setuptools builds, and the fresh environment reaches the running interpreter's
torch and numpy (and setuptools, to build the sdist) through a ``.pth`` file, which adds those
directories to ``sys.path`` without running the ``.pth`` files inside them, so the editable
install of this checkout stays out of it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 240
INSTALL_TIMEOUT_S = 240
SMOKE_TIMEOUT_S = 180


def _version() -> str:
    """``__version__`` of qcomm/__init__.py, read as setuptools reads it (without importing)."""
    tree = ast.parse((REPO / "qcomm" / "__init__.py").read_text())
    values = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
              and isinstance(node.value, ast.Constant)]
    assert len(values) == 1, "qcomm/__init__.py must assign __version__ one string literal"
    return values[0]


VERSION = _version()


def _package_files() -> set[str]:
    """Every file of the checkout's package, relative to the repository (bytecode aside)."""
    return {p.relative_to(REPO).as_posix() for p in (REPO / "qcomm").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")}


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, (f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}"
                                  f"\nstderr:\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist and the wheel ``python -m build`` makes of this checkout (the wheel is built
    from the sdist, as ``build`` does by default)."""
    pytest.importorskip("build", reason="the `build` package (in the `test` extra)")
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)],
         BUILD_TIMEOUT_S, cwd=REPO)
    sdists, wheels = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(p.name for p in out.iterdir())
    return {"sdist": sdists[0], "wheel": wheels[0]}


def test_the_version_is_written_once() -> None:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
        import tomli as tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"], "pyproject.toml must not repeat the version"
    assert "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "qcomm.__version__"
    changelog = (REPO / "CHANGELOG.md").read_text().splitlines()
    assert any(line.startswith(f"## {VERSION} ") or line == f"## {VERSION}"
               for line in changelog), f"CHANGELOG.md has no '## {VERSION}' section"


def test_the_wheel_holds_the_package_and_nothing_else(dists: dict[str, Path]) -> None:
    wheel = dists["wheel"]
    assert wheel.name == f"qcomm-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = zf.read(f"qcomm-{VERSION}.dist-info/METADATA").decode()
    dist_info = {n for n in names if n.startswith(f"qcomm-{VERSION}.dist-info/")}
    assert names - dist_info == _package_files()
    assert f"\nVersion: {VERSION}\n" in metadata
    assert "Requires-Dist: torch" in metadata


def test_the_sdist_holds_the_package_and_no_tests_or_bench(dists: dict[str, Path]) -> None:
    sdist = dists["sdist"]
    root = f"qcomm-{VERSION}"
    assert sdist.name == f"{root}.tar.gz"
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if m.isfile()]
        pkg_info = tf.extractfile(f"{root}/PKG-INFO").read().decode()  # type: ignore[union-attr]
    names = {m.name for m in members}
    assert all(n.startswith(f"{root}/") for n in names), sorted(names)
    relative = {n[len(root) + 1:] for n in names}
    package = {n for n in relative if n.startswith("qcomm/")}
    assert package == _package_files()
    assert {"pyproject.toml", "README.md", "PKG-INFO"} <= relative
    stray = sorted(n for n in relative if n.split("/")[0] in ("tests", "bench")
                   or "__pycache__" in n or n.endswith(".pyc"))
    assert not stray, f"the sdist ships {stray}"
    assert f"\nVersion: {VERSION}\n" in pkg_info


SMOKE = r"""
import hashlib, importlib.metadata, json, sys
import torch
import qcomm
from qcomm.compress import QuantSpec, dequantize, packed_nbytes, quantize
from qcomm.sgd import ASSGD

x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
payloads = {}
for bits in (1, 2, 4, 8):
    spec = QuantSpec(bits=bits, block_size=128, rounding="stochastic")
    packed = quantize(x, spec, seed=7)
    assert packed.nbytes == packed_nbytes(x.numel(), spec)
    y = dequantize(packed)
    assert y.shape == x.shape and y.dtype == x.dtype and bool(torch.isfinite(y).all())
    if bits == 8:
        assert float((y - x).abs().max()) <= 2 * float(x.abs().max()) / 127
    payloads[bits] = hashlib.sha256(packed.payload.numpy().tobytes()).hexdigest()

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))

ref, ours = model(), model()
sgd = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
assgd = ASSGD(ours.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
data = torch.randn(16, 7, generator=torch.Generator().manual_seed(1))
for _ in range(2):
    for m, opt in ((ref, sgd), (ours, assgd)):
        opt.zero_grad()
        m(data).square().mean().backward()
        opt.step()
for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
    assert torch.equal(a, b), (a - b).abs().max()
assgd.close()
print(json.dumps({"file": qcomm.__file__, "version": qcomm.__version__,
                  "dist_version": importlib.metadata.version("qcomm"),
                  "prefix": sys.prefix, "payloads": payloads}))
"""


def _reference_payloads() -> dict[str, str]:
    """The smoke script's payload hashes, made by this checkout's codec in this process."""
    import torch

    from qcomm.compress import QuantSpec, quantize

    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    out = {}
    for bits in (1, 2, 4, 8):
        packed = quantize(x, QuantSpec(bits=bits, block_size=128, rounding="stochastic"), seed=7)
        out[str(bits)] = hashlib.sha256(packed.payload.numpy().tobytes()).hexdigest()
    return out


def _fresh_venv(where: Path) -> Path:
    """A virtual environment without pip or system site packages, whose ``sys.path`` also
    holds the directories of the running interpreter's torch, numpy and setuptools."""
    import numpy
    import setuptools
    import torch

    _run([sys.executable, "-m", "venv", "--without-pip", str(where)], INSTALL_TIMEOUT_S)
    python = where / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                INSTALL_TIMEOUT_S).stdout.strip()
    outer = dict.fromkeys(str(Path(m.__file__).resolve().parents[1])
                          for m in (torch, numpy, setuptools))
    Path(site, "outer_site_packages.pth").write_text("".join(f"{d}\n" for d in outer))
    return python


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_installs_into_a_fresh_environment_and_runs(kind: str, dists: dict[str, Path],
                                                    tmp_path: Path) -> None:
    python = _fresh_venv(tmp_path / "venv")
    # --ignore-installed: the .pth makes this checkout's editable install visible to pip (its
    # dist-info sits beside torch); pip must neither skip the install nor try to remove it.
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", "--no-build-isolation", "--ignore-installed", "--no-cache-dir",
          "--disable-pip-version-check", "--quiet", str(dists[kind])],
         INSTALL_TIMEOUT_S, cwd=tmp_path)
    script = tmp_path / "smoke.py"
    script.write_text(SMOKE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    # -I: no PYTHONPATH, no user site, and neither the script's directory nor the working
    # directory on sys.path.
    proc = _run([str(python), "-I", str(script)], SMOKE_TIMEOUT_S, cwd=tmp_path, env=env)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    venv = (tmp_path / "venv").resolve()
    assert Path(report["prefix"]).resolve() == venv
    assert Path(report["file"]).resolve().is_relative_to(venv), (
        f"imported {report['file']}, not the {kind} installed in {venv}")
    assert report["version"] == report["dist_version"] == VERSION
    assert report["payloads"] == _reference_payloads()
