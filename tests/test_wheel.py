"""A wheel is a whole install (issue 52, item 1): built from a copy of the checkout, installed into a fresh
environment, and used from an empty directory, it has the built-in recipes and the docs its messages cite."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import REPO

# What a build reads (pyproject.toml, setup.py and MANIFEST.in say the rest).
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "LICENSE", "README.md", "delft", "recipes", "docs")


def build_wheel(tmp_path: Path) -> Path:
    """The wheel of a copy of the checkout (so the build writes nothing into it), without the network."""
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copyfile
        kwargs = {"ignore": shutil.ignore_patterns("__pycache__", "*.pyc", "_shipped")} if (REPO / name).is_dir() else {}
        copy(REPO / name, src / name, **kwargs)
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(out), str(src)], check=True, capture_output=True, text=True, timeout=600)
    wheels = list(out.glob("delft_digits-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def install(wheel: Path, venv: Path) -> Path:
    """A fresh venv that sees the system's packages (torch and the rest) with only the wheel installed in it; its
    ``delft`` command."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True,
                   timeout=300)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], check=True,
                   capture_output=True, text=True, timeout=600)
    return venv / "bin" / "delft"


def run(delft: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", COLUMNS="200")
    return subprocess.run([str(delft), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_wheel_installed_alone_starts_the_quickstart_from_an_empty_directory(tmp_path, tiny_model_dir):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "delft/_shipped/recipes/quickstart.yaml" in names and "delft/_shipped/docs/refusals.md" in names
    shipped = {n for n in names if n.startswith("delft/_shipped/recipes/")}
    assert len(shipped) == len(list((REPO / "recipes").rglob("*.yaml")))
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in meta and "Author: " in meta
    assert "Description-Content-Type: text/markdown" in meta and "delft" in meta.split("\n\n", 1)[1]

    delft = install(wheel, tmp_path / "venv")
    empty = tmp_path / "empty"
    empty.mkdir()
    where = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c", "import delft; print(delft.__file__)"],
                           cwd=empty, capture_output=True, text=True, check=True).stdout
    assert str(tmp_path / "venv") in where  # the wheel's copy, not the checkout's

    listed = run(delft, "recipe", "list", cwd=empty)
    assert listed.returncode == 0, listed.stderr
    assert "quickstart" in listed.stdout and "_shipped" in listed.stdout
    checked = run(delft, "recipe", "check", "quickstart", cwd=empty)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "valid recipe" in checked.stdout and "smollm2-135m" in checked.stdout

    made = run(delft, "recipe", "new", "quickstart", "my.yaml", cwd=empty)
    assert made.returncode == 0, made.stderr
    text = (empty / "my.yaml").read_text()
    assert text.startswith("# Written by `delft recipe new quickstart`") and "# delft train my.yaml" in text
    assert run(delft, "recipe", "check", "my.yaml", cwd=empty).returncode == 0

    page = run(delft, "docs", "recipes", cwd=empty)
    assert page.returncode == 0 and page.stdout == (REPO / "docs" / "recipes.md").read_text()
    missing = run(delft, "train", "recipes/nothing.yaml", cwd=empty)
    assert missing.returncode == 2 and "delft recipe list" in missing.stderr and "see recipes/" not in missing.stderr

    # A couple of training steps of the built-in quickstart, on a tiny model (the real one is not fetched here).
    trained = run(delft, "train", "quickstart", "--set", f"model.name={tiny_model_dir}", "--set", "train.max_steps=2",
                  "--set", "train.eval_steps=2", "--set", "train.save_steps=2", "--set", "data.synthetic.n=40",
                  "--set", "data.val_size=4", cwd=empty)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert (empty / "runs" / "quickstart" / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in empty.iterdir()) == ["my.yaml", "runs"]
