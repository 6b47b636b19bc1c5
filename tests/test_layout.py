"""The tree is the architecture: packaging and import layering."""

from __future__ import annotations

import ast
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAPPED = ["bus", "actors", "kernels", "gateway", "ops"]


def _package_dirs() -> set[str]:
    found = {"shunter"}
    for top in MAPPED:
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT)
            found.add("shunter." + ".".join(rel.parts))
    return found


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    missing = _package_dirs() - listed
    assert not missing, f"package folders missing from pyproject's package list: {sorted(missing)}"
    stale = listed - _package_dirs()
    assert not stale, f"pyproject lists packages with no folder: {sorted(stale)}"


def test_wheel_holds_every_package_and_no_generic_top_level(tmp_path):
    # built from a copy: setuptools leaves build/ and *.egg-info in the source tree
    src = tmp_path / "src"
    skip = (".venv", ".git", "build", "*.egg-info", "__pycache__", ".whl", ".gguf", ".ficache*")
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*skip))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(src)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("shunter-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"shunter"}, tops
    in_wheel = {
        "/".join(n.split("/")[:-1]).replace("/", ".") for n in names if n.endswith("/__init__.py")
    }
    assert _package_dirs() <= in_wheel, sorted(_package_dirs() - in_wheel)
    assert not any(n.startswith("shunter/tests/") for n in names)


def _imports(path: pathlib.Path) -> set[str]:
    mods: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module.split(".")[0])
    return mods


# (third-party module, the only top-level folders that may import it)
OWNERS = [("zmq", {"bus"}), ("aiohttp", {"gateway", "ops"}), ("triton", {"kernels"}),
          ("flashinfer", {"kernels"})]  # fmt: skip


@pytest.mark.parametrize(("module", "owners"), OWNERS)
def test_import_layering(module, owners):
    bad = [
        str(p.relative_to(ROOT))
        for top in MAPPED
        if top not in owners
        for p in (ROOT / top).rglob("*.py")
        if module in _imports(p)
    ]
    assert not bad, f"{module} imported outside {owners}: {bad}"


def test_actor_cores_are_pure():
    """Cores import neither the bus transports nor anyio, and read no clock/env/RNG."""
    banned_mods = {"anyio", "zmq", "asyncio", "time", "os", "random"}
    for p in (ROOT / "actors").rglob("*core*.py"):
        bad = _imports(p) & banned_mods
        assert not bad, f"{p.relative_to(ROOT)} imports {bad}"


def test_a_checkout_root_on_sys_path_does_not_shadow_top_level_packages():
    """Run from a checkout, the working directory (the package itself) is on sys.path;
    importing shunter takes it off, so `kernels`, `ops`, ... stay the installed
    packages of those names (transformers imports the Hub's `kernels`)."""
    names = ("kernels", "ops", "bus", "gateway", "actors")
    code = ("import importlib.util, shunter; "
            f"print('\\n'.join(str(getattr(importlib.util.find_spec(n), 'origin', None)) "
            f"for n in {names!r}))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    origins = dict(zip(names, out.splitlines(), strict=True))
    shadowed = {n: o for n, o in origins.items() if o.startswith(str(ROOT / n) + os.sep)}
    assert not shadowed, shadowed


def test_the_model_and_executor_import_no_triton():
    """Triton kernel modules are imported where a kernel first launches, never with the
    model: a @triton.jit made at import time binds to the compiler or the interpreter
    by TRITON_INTERPRET as it stands then, and the CPU path needs no Triton at all."""
    code = ("import sys, shunter.actors.executor.models.llama, shunter.actors.executor.actor; "
            "print(sorted(m for m in sys.modules if m == 'triton' or m.endswith('_triton')))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    assert out.strip() == "[]", out
