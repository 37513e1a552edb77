"""delft export --gguf: llama.cpp's converter from PyPI, the files checked by llama.cpp, the Modelfile, refusals.

The slow tests train SmolLM2-135M (the packaged default model) two steps, export it to f16, q8_0 and q4_k_m GGUF
plus a GGUF LoRA, and check the result in llama.cpp (llama-cpp-python, the [gguf] extra) independently of
delft's own check: other prompts, plain llama_cpp and transformers calls.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, run_cli

from delft.errors import UserError, VerificationError
from delft.export.gguf import (
    CONVERTER_FILES,
    MARKER,
    MODELFILE,
    _extract_converter,
    ollama_modelfile,
    parse_types,
    prepare_gguf,
)
from delft.export.gguf_check import TOLERANCE, logit_gap

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
PROMPTS = ("Q: 45 + 38 =\nA:", "Seven times eight is")  # not among the export's own check prompts


# ----------------------------------------------------------------------------- fast: the pieces


def test_parse_types_normalises_and_refuses_unknown():
    assert parse_types(["F16", "q4-K-M", "f16", "q8_0"]) == ["f16", "q4_k_m", "q8_0"]
    with pytest.raises(UserError, match="unknown GGUF type 'q9'"):
        parse_types(["q9"])
    assert all(t in TOLERANCE for t in parse_types(["f32", "bf16", "q6_k", "q2_k"]))


def test_compare_is_the_normalised_squared_error():
    ref = [np.array([[3.0, 4.0], [0.0, 1.0]]), np.array([[1.0, 0.0, 9.0]])]  # llama.cpp may pad the vocabulary
    got = [np.array([[3.0, 4.5], [0.5, 1.0]]), np.array([[1.0, 2.0]])]
    nse, agree, n = logit_gap(got, ref)
    assert n == 3 and nse == pytest.approx((0.25 + 0.25 + 4.0) / (25 + 1 + 1))
    assert agree == pytest.approx(2 / 3)  # the last row's argmax moved from 0 to 1


def test_modelfile_translates_chatml_and_its_default_system(tiny_tokenizer):
    tok = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tok.chat_template = CHATML
    text, notes = ollama_modelfile(tok, "m-f16.gguf")
    assert not notes and text.startswith("FROM ./m-f16.gguf\nTEMPLATE \"\"\"")
    assert 'SYSTEM """Be brief."""' in text and 'PARAMETER stop "<|im_end|>"' in text
    assert 'PARAMETER stop "</s>"' in text  # the tokenizer's eos
    text, _ = ollama_modelfile(tok, "base.gguf", adapter_file="lora.gguf")
    assert "ADAPTER ./lora.gguf" in text
    tok.chat_template = CHATML.replace("'\n' + message['content']", "': ' + message['content']")  # not ChatML
    text, notes = ollama_modelfile(tok, "m-f16.gguf")
    assert "TEMPLATE" not in text and notes and "not ChatML" in notes[0]


def test_modelfile_skips_a_template_it_cannot_translate(tiny_tokenizer):
    text, notes = ollama_modelfile(tiny_tokenizer, "m-q8_0.gguf")
    assert text == "FROM ./m-q8_0.gguf\n" and "not ChatML" in notes[0]


def test_modelfile_prompts_as_the_run_trained_and_decodes_as_delft_evaluated(tiny_tokenizer, tmp_path,
                                                                             tiny_model_dir):
    """A run trained on plain prompts gets a plain template and delft's plain stops; a run with its own system
    prompt gets that one, not the tokenizer's default; both decode greedily for eval.max_new_tokens tokens."""
    from helpers import recipe_file

    from delft.recipe.files import load_recipe

    tok = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tok.chat_template = CHATML
    plain = load_recipe(recipe_file(tmp_path, tiny_model_dir, name="plain", data={"template": "plain"},
                                    eval={"max_new_tokens": 17}))
    text, notes = ollama_modelfile(tok, "m-f16.gguf", recipe=plain)
    assert 'TEMPLATE """{{ .Prompt }}\n"""' in text and "<|im_start|>" not in text and not notes
    assert r'PARAMETER stop "\n\n"' in text and "PARAMETER temperature 0" in text  # escaped, as Go quotes it and "PARAMETER num_predict 17" in text
    chat = load_recipe(recipe_file(tmp_path, tiny_model_dir, name="chat",
                                   data={"template": "chat", "system_prompt": "Answer with a number."}))
    text, _ = ollama_modelfile(tok, "m-f16.gguf", recipe=chat)
    assert 'SYSTEM """Answer with a number."""' in text and "Be brief." not in text and "<|im_start|>" in text


def _sdist(path: Path, members: dict) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_extract_converter_takes_only_the_converter(tmp_path):
    root = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
    members = {root + f: b"# script" for f in CONVERTER_FILES}
    members.update({root + "conversion/__init__.py": b"", root + "conversion/llama.py": b"x = 1",
                    root + "gguf-py/gguf/__init__.py": b"", root + "gguf-py/tests/test_x.py": b"",
                    root + "ggml/src/big.c": b"int x;", root + "../../escape.py": b"no",
                    "llama_cpp_python-0.3.36/llama_cpp/llama.py": b""})
    dest = tmp_path / "conv"
    _extract_converter(_sdist(tmp_path / "s.tar.gz", members), dest)
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert got == sorted([*CONVERTER_FILES, "conversion/__init__.py", "conversion/llama.py",
                          "gguf-py/gguf/__init__.py"])
    assert not (tmp_path / "escape.py").exists()
    del members[root + "conversion/__init__.py"]
    with pytest.raises(UserError, match="does not contain llama.cpp's converter"):
        _extract_converter(_sdist(tmp_path / "t.tar.gz", members), tmp_path / "conv2")
    assert not (tmp_path / "conv2").exists()


def test_prepare_refuses_before_any_download(tmp_path, monkeypatch):
    monkeypatch.setenv("DELFT_LLAMA_CPP_SDIST", str(tmp_path / "absent.tar.gz"))  # a download would fail loudly
    assert prepare_gguf(tmp_path, tmp_path / "o", []) is None
    with pytest.raises(UserError, match="--gguf-check needs"):
        prepare_gguf(tmp_path, tmp_path / "o", [], check=True)
    with pytest.raises(UserError, match="nf4 round-trip"):
        prepare_gguf(tmp_path, tmp_path / "o", [], lora=True, match_training=True)
    with pytest.raises(UserError, match="does not exist"):
        prepare_gguf(tmp_path / "no-run", tmp_path / "o", ["f16"])
    res = run_cli("export", tmp_path / "no-run", "--out", tmp_path / "o", "--gguf", "q7")
    assert res.exit_code == 2 and "unknown GGUF type" in res.output


def test_a_read_only_cache_is_refused_before_the_converter_is_fetched(tmp_path, monkeypatch):
    from helpers import read_only_dir

    from delft.export.gguf import ensure_converter

    monkeypatch.setenv("DELFT_LLAMA_CPP_SDIST", str(tmp_path / "absent.tar.gz"))  # a download would fail loudly
    with read_only_dir(tmp_path / "cache") as cache:
        monkeypatch.setenv("DELFT_CACHE", str(cache))
        with pytest.raises(UserError, match="DELFT_CACHE.*cannot be used"):
            ensure_converter()


# ----------------------------------------------------------------------------- slow: SmolLM2 through llama.cpp


@pytest.fixture(scope="module")
def smol_run(tmp_path_factory) -> Path:
    """SmolLM2-135M trained two steps (the packaged quickstart recipe, shortened)."""
    from delft.recipe.files import load_recipe
    from delft.training.stages import run_training

    root = tmp_path_factory.mktemp("gguf")
    quickstart = REPO / "recipes" / "quickstart.yaml"
    recipe = load_recipe(quickstart, ["train.max_steps=2", "train.eval_steps=2", "data.synthetic.n=48",
                                      "data.val_size=8", f"output.dir={root / 'run'}", "model.device=cpu"])
    return run_training(recipe)


@pytest.fixture(scope="module")
def smol_export(smol_run, tmp_path_factory) -> tuple[Path, object]:
    parent, cwd = tmp_path_factory.mktemp("gguf-out"), os.getcwd()
    os.chdir(parent)  # a relative --out, as people type it
    try:
        res = run_cli("export", smol_run, "--out", "smol", "--gguf", "f16", "--gguf", "q8_0", "--gguf", "q4_k_m",
                      "--gguf-lora", "--gguf-check")
    finally:
        os.chdir(cwd)
    return parent / "smol", res


def _llama(path: Path, lora: Path = None):
    from llama_cpp import Llama

    return Llama(model_path=str(path), lora_path=str(lora) if lora else None, logits_all=True, n_ctx=128,
                 verbose=False)


def _llama_logits(llm, ids) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)])


def _nse(a, b) -> float:
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


@pytest.mark.slow
@pytest.mark.gguf
def test_smollm2_gguf_written_and_checked_by_llama_cpp(smol_export):
    out, res = smol_export
    assert res.exit_code == 0, res.output
    for name in ("smol-f16.gguf", "smol-q8_0.gguf", "smol-q4_k_m.gguf", "smol-lora-f16.gguf",
                 "smol-base-f16.gguf", MODELFILE, "config.json"):
        assert (out / name).is_file(), name
    assert not (out / MARKER).exists() and not [p for p in out.iterdir() if ".tmp-" in p.name]
    sizes = {f: (out / f"smol-{f}.gguf").stat().st_size for f in ("f16", "q8_0", "q4_k_m")}
    assert sizes["f16"] > sizes["q8_0"] > sizes["q4_k_m"]

    info = json.loads((out / "delft_export.json").read_text())["gguf"]
    files = {f["file"]: f for f in info["files"]}
    assert info["checked_in_llama_cpp"] and info["converter"] == "llama-cpp-python==0.3.36"
    for name, f in files.items():
        if f["kind"] != "base":
            assert f["passed"] and f["nse"] <= f["tolerance"] == TOLERANCE[f["type"]], name
            assert f["positions"] > 20 and f["greedy_reference"], name
    assert files["smol-f16.gguf"]["nse"] < 1e-4 and files["smol-f16.gguf"]["argmax_agreement"] == 1.0
    assert files["smol-f16.gguf"]["nse"] < files["smol-q8_0.gguf"]["nse"] < files["smol-q4_k_m.gguf"]["nse"]
    card = (out / "README.md").read_text()
    assert "## GGUF" in card and "smol-q4_k_m.gguf" in card and "llama-cli -m smol-base-f16.gguf" in card
    modelfile = (out / MODELFILE).read_text()
    assert modelfile.startswith("FROM ./smol-f16.gguf\n") and "<|im_start|>{{ .Role }}" in modelfile
    assert 'SYSTEM """You are a helpful AI assistant named SmolLM' in modelfile


@pytest.mark.slow
@pytest.mark.gguf
def test_llama_cpp_reproduces_transformers_and_the_lora_the_merge(smol_export, smol_run):
    """Without delft's check code: f16 GGUF vs the merged directory, and base GGUF + LoRA GGUF vs merged GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, res = smol_export
    assert res.exit_code == 0, res.output
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    merged, lora, base = (_llama(out / "smol-f16.gguf"), _llama(out / "smol-base-f16.gguf", out / "smol-lora-f16.gguf"),
                          _llama(out / "smol-base-f16.gguf"))
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids])).logits[0].numpy()
        got = _llama_logits(merged, ids)
        assert got.shape == ref.shape and _nse(got, ref) < 1e-4
        assert (got.argmax(-1) == ref.argmax(-1)).all()
        with_lora, plain = _llama_logits(lora, ids), _llama_logits(base, ids)
        # the adapter moved the model (two steps) and llama.cpp's LoRA reproduces the merge far closer than that
        assert _nse(with_lora, got) < 0.05 * _nse(plain, got), prompt
    for llm in (merged, lora, base):
        llm.close()


@pytest.mark.slow
@pytest.mark.gguf
def test_refuses_what_llama_cpp_cannot_convert_before_the_merge(tmp_path, tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from delft.rundir import write_info

    run = tmp_path / "run"  # an untrained LoRA adapter on the tiny model: all a run directory needs here
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    get_peft_model(model, LoraConfig(r=4, target_modules="all-linear")).save_pretrained(run)
    write_info(run, {"base_model": str(tiny_model_dir), "status": "completed"})
    # the tiny model's character-level tokenizer is no pre-tokenizer llama.cpp implements
    res = run_cli("export", run, "--out", tmp_path / "o", "--gguf", "f16")
    assert res.exit_code == 2 and "does not recognise the tokenizer" in res.output, res.output
    assert not (tmp_path / "o").exists()

    other = tmp_path / "other-arch"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    info = json.loads((run / "delft_run.json").read_text())
    (run / "delft_run.json").write_text(json.dumps({**info, "base_model": str(other)}))
    with pytest.raises(UserError, match="does not support the architecture NoSuchModelForCausalLM"):
        prepare_gguf(run, tmp_path / "o", ["q8_0"])


@pytest.mark.slow
@pytest.mark.gguf
def test_failed_check_keeps_the_files_and_says_so(smol_export, smol_run, tmp_path, monkeypatch):
    import delft.export.gguf as gguf
    import delft.export.gguf_check as gguf_check
    from delft.export.report import ExportResult

    out, res = smol_export
    assert res.exit_code == 0, res.output
    again = tmp_path / "again"
    shutil.copytree(out, again, ignore=shutil.ignore_patterns("*.gguf", MODELFILE))
    result = ExportResult(out=str(again), run_dir=str(smol_run), base_model="smollm2-135m", merge="16-bit",
                          merge_detail="", dtype="bfloat16")
    plan = prepare_gguf(smol_run, tmp_path / "unused", ["q8_0"], check=True)
    monkeypatch.setitem(gguf_check.TOLERANCE, "q8_0", 0.0)
    with pytest.raises(VerificationError, match="again-q8_0.gguf"):
        gguf.export_gguf(plan, result)
    assert (again / "again-q8_0.gguf").is_file() and (again / MARKER).is_file()
    info = json.loads((again / "delft_export.json").read_text())["gguf"]
    assert info["files"][0]["passed"] is False and "FAILED" in (again / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.gguf
def test_a_llama_cpp_crash_is_reported_and_the_gguf_phase_resumes(smol_export, smol_run, tmp_path, monkeypatch):
    """A child that dies by SIGILL stands in for llama.cpp on a CPU that traps an instruction it advertises: delft
    says so in one paragraph (exit 2), keeps what it wrote, and the same command then redoes only the GGUF phase."""
    import delft.export.gguf_check as gguf_check

    out, res = smol_export
    assert res.exit_code == 0, res.output
    again = tmp_path / "again"
    shutil.copytree(out, again, ignore=shutil.ignore_patterns("*.gguf", MODELFILE))
    weights = sorted(again.glob("*.safetensors"))
    stamps = {p: p.stat().st_mtime_ns for p in weights}
    crash = tmp_path / "crash.py"
    crash.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n")
    monkeypatch.setattr(gguf_check, "CHILD", [sys.executable, str(crash)])
    r = run_cli("export", smol_run, "--out", again, "--gguf", "q8_0", "--gguf-check")
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "SIGILL" in text and "redoes only the GGUF phase" in text, r.output
    assert "resuming" in text and (again / "again-q8_0.gguf").is_file()  # the file it wrote is kept
    info = json.loads((again / "delft_export.json").read_text())
    assert info["passed"] is True and [f["passed"] for f in info["gguf"]["files"]] == [None]
    monkeypatch.setattr(gguf_check, "CHILD", [sys.executable, "-m", "delft.export.gguf_check"])
    r = run_cli("export", smol_run, "--out", again, "--gguf", "q8_0", "--gguf-check")
    assert r.exit_code == 0, r.output
    assert {p: p.stat().st_mtime_ns for p in weights} == stamps  # the merged model was not written again
    info = json.loads((again / "delft_export.json").read_text())
    assert [f["passed"] for f in info["gguf"]["files"]] == [True]
    assert (again / "README.md").read_text().count("## GGUF") == 1


@pytest.mark.slow
@pytest.mark.gguf
def test_the_f16_gguf_answers_as_the_merged_model_in_delft_eval(smol_export, tmp_path):
    """delft eval's llama.cpp backend: the f16 file gives the merged model's greedy answers on 100 problems (the
    quickstart recipe's held-out set), and samples through llama.cpp are seeded."""
    out, res = smol_export
    assert res.exit_code == 0, res.output
    report = tmp_path / "eval.json"
    r = run_cli("eval", REPO / "recipes" / "quickstart.yaml", out, out / "smol-f16.gguf", "--no-base", "--limit", 100,
                "--json", report, "--set", "model.device=cpu")
    assert r.exit_code == 0, r.output
    merged, f16 = json.loads(report.read_text())["models"]
    assert f16["adapter"].endswith("smol-f16.gguf") and len(f16["predictions"]) == 100
    same = sum(a["extracted"] == b["extracted"] for a, b in zip(merged["predictions"], f16["predictions"]))
    assert same >= 95, f"the f16 GGUF gave the merged model's answer on {same} of 100 problems"
    sampled = [tmp_path / f"s{i}.json" for i in range(3)]
    for path, seed in zip(sampled, (0, 0, 1)):
        r = run_cli("eval", "--model", out / "smol-f16.gguf", "--backend", "llama.cpp", "--data", "synthetic",
                    "--limit", 4, "--samples", 3, "--temperature", 1.0, "--json", path, "--set", f"eval.seed={seed}")
        assert r.exit_code == 0, r.output
    texts = [[[s["generated"] for s in p["samples"]] for p in json.loads(path.read_text())["models"][0]["predictions"]]
             for path in sampled]
    assert texts[0] == texts[1] != texts[2] and all(len(t) == 3 for t in texts[0])


@pytest.mark.slow
@pytest.mark.gguf
def test_the_export_reports_what_quantisation_did_to_the_numbers(smol_export):
    out, res = smol_export
    assert res.exit_code == 0, res.output
    files = {f["file"]: f for f in json.loads((out / "delft_export.json").read_text())["gguf"]["files"]}
    for name in ("smol-f16.gguf", "smol-q8_0.gguf", "smol-q4_k_m.gguf", "smol-lora-f16.gguf"):
        probe, tokens = files[name]["probe"], files[name]["number_tokens"]
        assert probe["n"] == 40 and 0 <= probe["exact_match"] <= 1 and 0 <= probe["same_answers"] <= 1, name
        assert probe["reference_exact_match"] == files["smol-f16.gguf"]["probe"]["reference_exact_match"]
        assert tokens["match"] and tokens["texts"] >= 10, name  # SmolLM2's digits split alike in llama.cpp
    assert files["smol-f16.gguf"]["probe"]["same_answers"] >= 0.95
    assert files["smol-base-f16.gguf"]["probe"] is None
    card = (out / "README.md").read_text()
    assert "What quantisation did to the numbers" in card and "| smol-q4_k_m.gguf |" in card
    assert "probe smol-q4_k_m.gguf: exact match" in " ".join(res.output.split())


@pytest.mark.slow
@pytest.mark.gguf
def test_a_llama_cpp_crash_in_eval_is_one_paragraph(tmp_path, monkeypatch, digit_model_path):
    import delft.evaluation.gguf_backend as backend

    crash = tmp_path / "crash.py"
    crash.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    monkeypatch.setattr(backend, "CHILD", [sys.executable, str(crash)])
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")
    shutil.copy(digit_model_path / "tokenizer.json", tmp_path / "tokenizer.json")
    shutil.copy(digit_model_path / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    r = run_cli("eval", "--model", digit_model_path, "--data", "synthetic", "--limit", 2, "--no-base", fake)
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "llama.cpp died while answering with model.gguf" in text, r.output
    assert "SIGSEGV" in text and "Traceback" not in r.output


def test_a_killed_delft_leaves_no_child_and_no_half_written_file(tmp_path):
    """kill -9 of delft while a child (converter, quantiser, llama.cpp check) writes: the guardian kills the child
    and removes the file it was writing (delft.children)."""
    import signal
    import subprocess
    import time

    owned = tmp_path / ".m-f16.gguf.tmp-1"
    parent = tmp_path / "parent.py"
    parent.write_text("import sys\nfrom delft import children\n"
                      f"open({str(owned)!r}, 'w').write('x' * 1000)\nprint('started', flush=True)\n"
                      f"children.run(['sleep', '119.5'], [{str(owned)!r}])\n")
    proc = subprocess.Popen([sys.executable, str(parent)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "started"

    def sleepers():
        out = []
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and b"119.5" in (d / "cmdline").read_bytes() and \
                        (d / "stat").read_text().split(") ")[1][0] != "Z":
                    out.append(int(d.name))
            except OSError:
                pass
        return out

    end = time.monotonic() + 20
    while not sleepers() and time.monotonic() < end:
        time.sleep(0.1)
    assert sleepers(), "the child never started"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    end = time.monotonic() + 60  # the guardian is a fresh Python process: slow to act on a loaded machine
    while (sleepers() or owned.exists()) and time.monotonic() < end:
        time.sleep(0.2)
    left = sleepers()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left and not owned.exists(), (left, owned.exists())
