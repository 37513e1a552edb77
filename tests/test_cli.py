import os
import re
import subprocess
import sys

import pytest
import yaml
from helpers import run_cli
from tiny import save_tiny


def recipe(tmp_path, name="r", **sections):
    data = {"output": {"dir": str(tmp_path / "run")}}
    data.update(sections)
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_help_is_fast_and_imports_no_torch():
    """`delft --help` stays fast because the CLI imports torch and transformers only inside commands."""
    code = ("import sys; import delft.cli; from delft.cli import app; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import at module level'")
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    out = subprocess.run([sys.executable, "-m", "delft", "--help"], capture_output=True, text=True, check=True)
    assert "compare" in out.stdout and "inspect" in out.stdout


def test_recipe_check_ok_and_prints_resolved(tmp_path):
    r = run_cli("recipe", "check", recipe(tmp_path, train={"max_steps": 3}))
    assert r.exit_code == 0 and "max_steps: 3" in r.output and "learning_rate" in r.output


def test_user_mistakes_exit_2_without_traceback(tmp_path):
    cases = [
        ("recipe", "check", tmp_path / "missing.yaml"),
        ("recipe", "check", recipe(tmp_path, "a", train={"learing_rate": 1})),
        ("train", recipe(tmp_path, "b", model={"name": str(tmp_path / "no-such-model")})),
        ("train", recipe(tmp_path, "c", model={"name": "not a model"})),
    ]
    for args in cases:
        r = run_cli(*args)
        assert r.exit_code == 2, (args, r.output)
        assert "Traceback" not in r.output and "error:" in r.output


def test_cuda_requested_but_absent(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present, so a recipe asking for one is not refused")
    r = run_cli("train", recipe(tmp_path, model={"name": "x/y", "device": "cuda"}))
    assert r.exit_code == 2 and "CUDA was requested" in r.output


def test_glued_digit_tokenizer_refused_before_weights_load(tmp_path):
    # multi-digit number tokens (Llama-3 style) are trained per character; digits glued to other characters are not
    model_dir = save_tiny(tmp_path / "glued", glued_digits=True)
    for f in model_dir.glob("*.safetensors"):
        f.unlink()  # if delft tried to load weights first, the error would be about missing weights
    r = run_cli("train", recipe(tmp_path, model={"name": str(model_dir)}, loss={"type": "del"}))
    assert r.exit_code == 2
    assert "glued to other characters" in r.output and "loss.type 'del'" in r.output


@pytest.mark.slow
def test_hub_id_offline_fails_fast(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    # offline: refused at once instead of waiting on the network (a hang fails the test through the timeout)
    out = subprocess.run([sys.executable, "-m", "delft", "train", recipe(tmp_path, model={"name": "nobody/nothing"})],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2 and "hub cannot be reached" in out.stderr


def test_debug_shows_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "delft", "recipe", "check", tmp_path / "missing.yaml", "--debug"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "Traceback" in out.stderr and "UserError" in out.stderr


def test_train_via_cli_then_refuses_overwrite(tmp_path, tiny_model_dir):
    r = recipe(tmp_path, model={"name": str(tiny_model_dir)}, data={"synthetic": {"n": 16}, "val_size": 0},
               train={"max_steps": 1, "batch_size": 4})
    first = run_cli("train", r)
    assert first.exit_code == 0, first.output
    assert "trainable labels" in first.output and "digit labels" in first.output
    again = run_cli("train", r)
    assert again.exit_code == 2 and "--force" in again.output


def test_a_refusal_keeps_its_brackets_through_rich(capsys):
    """An install hint like pip install -e ".[gguf]" must print whole, not as rich markup (which ate "[gguf]")."""
    import typer

    from delft.cli import friendly
    from delft.errors import UserError

    @friendly
    def refuse():
        raise UserError("llama-cpp-python is not installed", "--gguf", 'pip install -e ".[gguf]" [bold]now[/bold]')

    try:
        refuse()
    except typer.Exit as e:
        assert e.exit_code == 2
    err = capsys.readouterr().err
    assert 'pip install -e ".[gguf]"' in " ".join(err.split()) and "[bold]now[/bold]" in err


def test_version_prints_delft_version_without_torch():
    """`delft --version` answers at once: the version, exit 0, and neither torch nor transformers imported."""
    from delft import __version__
    from delft.models.loading import bitsandbytes_line

    code = ("import sys; sys.argv = ['delft', '--version']\n"
            "try:\n    from delft.cli import main; main()\n"
            "finally:\n    print(sorted(m for m in ('torch', 'transformers', 'peft', 'datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [f"delft-digits {__version__} (the delft command)", bitsandbytes_line()]  # the installed bitsandbytes
    assert out.stdout.splitlines() == [*lines, "[]"], out.stdout + out.stderr
    assert run_cli("--version").output.strip() == "\n".join(lines)


def readme_commands() -> dict[str, str]:
    """The README's "## Commands" table: each row's first cell (`delft CMD ...`) by command name."""
    from helpers import REPO

    text = (REPO / "README.md").read_text(encoding="utf-8").split("## Commands", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `delft"):
            cell = line.split("`")[1]
            words = cell.split()
            name = " ".join(words[1:3]) if words[1] == "recipe" else words[1]
            rows[name] = cell
    return rows


def test_readme_commands_table_lists_every_option():
    """Every option of every command (as its --help shows it) is in that command's row of the README table."""
    import typer

    from delft.cli import app

    group = typer.main.get_command(app)
    commands = {}
    for name, cmd in group.commands.items():
        subs = cmd.commands.items() if hasattr(cmd, "commands") else [("", cmd)]  # typer's own click
        commands.update({f"{name} {sub}".strip(): c for sub, c in subs})
    rows = readme_commands()
    assert set(commands) <= set(rows), f"commands without a README row: {sorted(set(commands) - set(rows))}"
    missing = [f"{name}: {opt}" for name, cmd in commands.items() for p in cmd.params
               if p.param_type_name == "option" for opt in (*p.opts, *p.secondary_opts)
               if opt != "--help" and not re.search(rf"{re.escape(opt)}(?![\w-])", rows[name])]
    assert not missing, f"options missing from the README's commands table: {missing}"
    assert "--version" in rows.get("--version", "")
