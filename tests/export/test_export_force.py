"""`delft export --force` replaces only an earlier export (a directory holding delft_export.json), never a folder
of the user's files, the current directory, one above it, home, a file or a link; and an export killed with
SIGKILL leaves temporaries that the next export to that --out removes (a dead process's only)."""

import subprocess
from pathlib import Path

import pytest
from helpers import run_cli

from delft.rundir import EXPORT_INFO, MODEL_CONFIG


def files(root: Path) -> dict:
    """Every file under ``root`` and its bytes (links not followed)."""
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def refused(res, *words) -> None:
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and len([ln for ln in res.output.splitlines() if ln.strip()]) <= 3
    for w in words:
        assert w in res.output, (w, res.output)


def user_folder(path: Path, marker: bool = False) -> Path:
    """A folder of the user's files; with ``marker``, also a delft_export.json, so that only the place refuses."""
    (path / "docs").mkdir(parents=True)
    (path / "thesis.tex").write_text("chapter 1")
    (path / "docs" / "notes.txt").write_text("do not lose")
    if marker:
        (path / EXPORT_INFO).write_text("{}")
    return path


@pytest.mark.parametrize("where, said", [
    ("user folder", f"is not one (it has no {EXPORT_INFO})"),
    ("current directory", "holds the current directory or your home"),
    ("parent of the current directory", "holds the current directory or your home"),
    ("home", "holds the current directory or your home"),
    ("file", "is a file"),
    ("link to a folder", "is a symbolic link"),
])
def test_force_refuses_what_no_export_made(tiny_lora_run, tmp_path, monkeypatch, where, said):
    home = user_folder(tmp_path / "home", marker=True)
    monkeypatch.setenv("HOME", str(home))
    if where == "user folder":
        out = user_folder(tmp_path / "papers")
    elif where == "current directory":
        out = user_folder(tmp_path / "here", marker=True)
        monkeypatch.chdir(out)
    elif where == "parent of the current directory":
        out = user_folder(tmp_path / "up", marker=True)
        (out / "sub").mkdir()
        monkeypatch.chdir(out / "sub")
    elif where == "home":
        out = home
    elif where == "file":
        out = tmp_path / "model.bin"
        out.write_text("weights I made")
    else:
        out = tmp_path / "link"
        out.symlink_to(user_folder(tmp_path / "target"), target_is_directory=True)
    before = files(tmp_path)
    spelled = "." if where == "current directory" else ".." if where.startswith("parent") else str(out)
    refused(run_cli("export", tiny_lora_run, "--out", spelled, "--force"), "--out", said)
    assert files(tmp_path) == before  # nothing deleted, nothing written
    assert out.is_symlink() == (where == "link to a folder")


def test_force_replaces_an_earlier_export(tiny_lora_run, tmp_path):
    out = tmp_path / "merged"
    assert run_cli("export", tiny_lora_run, "--out", out, "--dtype", "float32").exit_code == 0
    assert (out / EXPORT_INFO).is_file()  # the marker every export writes
    (out / "stale.txt").write_text("from the earlier export")
    res = run_cli("export", tiny_lora_run, "--out", out, "--dtype", "float32", "--force")
    assert res.exit_code == 0, res.output
    assert (out / MODEL_CONFIG).is_file() and (out / EXPORT_INFO).is_file() and not (out / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]  # nothing left beside it


def test_force_into_an_empty_directory(tiny_lora_run, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    res = run_cli("export", tiny_lora_run, "--out", out, "--dtype", "float32", "--force")
    assert res.exit_code == 0, res.output
    assert (out / MODEL_CONFIG).is_file()


# ----------------------------------------------------------------------------- leftovers of a kill -9


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def plant(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"\0" * 64)  # half-written
    return path


def test_export_removes_a_killed_export_s_leftovers(tiny_lora_run, tmp_path):
    dead = dead_pid()
    gone = [plant(tmp_path / f".merged.tmp-{dead}-k2j4x"), plant(tmp_path / f".merged.old-{dead}")]
    other = plant(tmp_path / f".papers.tmp-{dead}-aaaa")  # another --out's: not this export's business
    res = run_cli("export", tiny_lora_run, "--out", tmp_path / "merged", "--dtype", "float32")
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if "leftover" in ln)
    assert f"Removed 2 half-written leftovers of a killed delft (process {dead}, no longer running)" in line
    assert not any(p.exists() for p in gone) and other.is_dir()
    assert (tmp_path / "merged" / MODEL_CONFIG).is_file()


def test_export_keeps_a_live_export_s_temporary(tiny_lora_run, tmp_path):
    dead, live = dead_pid(), subprocess.Popen(["sleep", "300"])
    try:
        gone = plant(tmp_path / f".merged.tmp-{dead}-k2j4x")
        kept = plant(tmp_path / f".merged.tmp-{live.pid}-abcd")
        res = run_cli("export", tiny_lora_run, "--out", tmp_path / "merged")
    finally:
        live.kill()
        live.wait()
    refused(res, f"another delft export (process {live.pid}) is writing", "--out")
    assert f"process {dead}" in res.output and not gone.exists()
    assert (kept / "model.safetensors").read_bytes() == b"\0" * 64
    assert not (tmp_path / "merged").exists()
