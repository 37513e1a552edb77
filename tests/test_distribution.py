"""The name pip installs: `delft-digits` (PyPI's `delft` is another project that also imports as `delft`), the
`delft` command in its wheel, and `delft --version` naming it and warning when the other package is beside it."""

import os
import subprocess
import sys
import zipfile

import pytest
from helpers import REPO, run_cli

from delft import DISTRIBUTION, __version__


def test_version_names_the_distribution():
    result = run_cli("--version")
    assert result.exit_code == 0
    assert result.output.startswith(f"delft-digits {__version__}")
    assert "pip uninstall delft" not in result.output  # the other package is not installed here


def test_version_warns_when_pypis_delft_shares_the_environment(tmp_path):
    """A real dist-info of the other project (as pip leaves it) on the path: importlib.metadata finds it."""
    info = tmp_path / "delft-1.2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: delft\nVersion: 1.2.0\n")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"}
    done = subprocess.run([sys.executable, "-m", "delft", "--version"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"delft-digits {__version__}")
    said = " ".join(done.stderr.split())
    assert "a package named 'delft' (1.2.0: PyPI's unrelated project" in said and "installed here too" in said
    assert "pip uninstall delft" in said


@pytest.mark.slow
def test_the_wheel_is_delft_digits_with_the_delft_command(tmp_path):
    """What `pip install` of this checkout installs: a wheel named delft_digits whose entry point is `delft`."""
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    wheels = list(tmp_path.glob("*.whl"))
    assert [w.name.split("-")[0] for w in wheels] == ["delft_digits"]
    with zipfile.ZipFile(wheels[0]) as whl:
        names = whl.namelist()
        meta = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry = whl.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert f"Name: {DISTRIBUTION}\n" in meta and f"Version: {__version__}\n" in meta
    assert "delft = delft.cli:main" in entry
    assert "delft/__init__.py" in names  # the import name stays delft
