"""delft export: merged model == base + adapter, dtypes, the nf4 round-trip merge, refusals, marked failures.

One tiny run is trained for real (2 steps) per module; its LoRA B matrices are then set to visible random
values so that the adapter moves logits by far more than any tolerance (2 steps at lr 2e-4 barely move them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers import run_cli
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny import save_tiny

from delft.errors import UserError
from delft.rundir import EXPORT_INFO
from delft.export.report import MARKER
from delft.export.merge import _describe_merge, write_merged_model
from delft.export.nf4 import dequantize_nf4, nf4_roundtrip, quantized_linear_names
from delft.export.report import eval_headline

PROMPT = "Compute 408 / 17 and 9.75 * 4."  # not one of the export's own check prompts
EVAL_JSON = {"models": [{"name": "base", "metrics": {"n": 64, "exact_match": 0.25, "digit_accuracy": 0.5}},
                        {"name": "run", "metrics": {"n": 64, "exact_match": 0.4375, "mae": 3.5}}]}


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, tmp_path_factory) -> Path:
    from delft.recipe.files import load_recipe
    from delft.training.stages import run_training

    root = tmp_path_factory.mktemp("export")
    recipe = {"model": {"name": str(tiny_model_dir), "device": "cpu"}, "quantization": {"mode": "none"},
              "data": {"source": "synthetic", "format": "synthetic", "synthetic": {"n": 32}, "max_length": 48},
              "train": {"max_steps": 2, "batch_size": 4, "gradient_checkpointing": False},
              "output": {"dir": str(root / "run")}}
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    run = run_training(load_recipe(root / "recipe.yaml"))
    path = run / "adapter_model.safetensors"
    weights = load_file(str(path))
    gen = torch.Generator().manual_seed(1)
    for k, v in weights.items():
        if "lora_B" in k:
            weights[k] = torch.randn(v.shape, generator=gen) * 0.05
    save_file(weights, str(path))
    (run / "eval.json").write_text(json.dumps(EVAL_JSON))
    return run


def _logits(model, tokenizer, text=PROMPT):
    with torch.no_grad():
        return model(**tokenizer(text, return_tensors="pt")).logits.float()


@pytest.fixture(scope="module")
def reference(run_dir, tiny_model_dir):
    """(base logits, base + adapter logits) computed without delft: plain transformers + peft, fp32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    plain = _logits(base, tok)
    with_adapter = _logits(PeftModel.from_pretrained(base, str(run_dir)).eval(), tok)
    return plain, with_adapter


def _tensors(directory: Path) -> dict:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


def _no_leftovers(parent: Path):
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


# ----------------------------------------------------------------------------- the merge itself


def test_adapter_changes_logits(reference):
    plain, with_adapter = reference
    assert (plain - with_adapter).abs().max() > 0.1  # otherwise the equality checks below prove nothing


def test_fp32_export_equals_base_plus_adapter(run_dir, reference, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged" / "fp32"
    result = write_merged_model(run_dir, out, dtype="float32", max_shard_size="40KB")
    assert result.passed and result.max_abs_diff <= 1e-4 and result.merge_abs_diff <= 1e-4
    assert result.adapter_effect > 0.1 and result.tensors_checked > 0 and not result.tensors_mismatched

    # loads with plain transformers, several shards + index, config, generation config, tokenizer, card
    assert result.shards > 1 and (out / "model.safetensors.index.json").is_file()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (out / name).is_file(), name
    assert not (out / MARKER).exists() and _no_leftovers(out.parent) == []
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.dtype == torch.float32
    merged = _logits(model, AutoTokenizer.from_pretrained(out))
    assert (merged - reference[1]).abs().max() <= 1e-4

    card = (out / "README.md").read_text()
    for text in (str(tiny_model_dir), "del", "0.03", "2 of 2", "exact_match 43.8%", "passed",
                 "into the original base weights", "r 16"):
        assert text in card, text
    info = json.loads((out / "delft_export.json").read_text())
    assert info["passed"] and info["dtype"] == "float32"


def test_bf16_default_via_cli(run_dir, reference, tmp_path):
    out = tmp_path / "bf16"
    res = run_cli("export", run_dir, "--out", out)
    assert res.exit_code == 0, res.output
    assert "max |Δlogit|" in res.output and "passed" in res.output
    tensors = _tensors(out)
    assert tensors and all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    merged = _logits(model, AutoTokenizer.from_pretrained(out))
    plain, with_adapter = reference
    # bf16 rounding stays well inside the adapter's own effect: it is the adapter, not the base
    assert (merged - with_adapter).abs().max() < 0.25 * (plain - with_adapter).abs().max()


def test_match_training_merges_into_nf4_roundtrip(run_dir, tiny_model_dir, tmp_path):
    out = tmp_path / "nf4"
    result = write_merged_model(run_dir, out, dtype="float32", match_training=True)
    assert result.passed and result.merge == "nf4 round-trip"
    assert "not quantised" in (out / "README.md").read_text()

    base = load_file(str(next(Path(tiny_model_dir).glob("*.safetensors"))))
    adapter = load_file(str(run_dir / "adapter_model.safetensors"))
    cfg = json.loads((run_dir / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    merged = _tensors(out)
    targeted = [k.split("base_model.model.")[1].replace(".lora_A.weight", "")
                for k in adapter if "lora_A" in k]
    assert len(targeted) == 14  # 7 projections x 2 layers (all-linear)
    for name in targeted:
        w = base[f"{name}.weight"]
        a = adapter[f"base_model.model.{name}.lora_A.weight"]
        b = adapter[f"base_model.model.{name}.lora_B.weight"]
        delta = scale * b @ a
        expected = nf4_roundtrip(w, double_quant=True) + delta
        got = merged[f"{name}.weight"]
        assert torch.allclose(got, expected, atol=1e-6), name
        assert (got - (w + delta)).abs().max() > 1e-3, name  # differs from the plain merge
    # layers bitsandbytes does not quantise are untouched
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(merged[name], base[name]), name


@pytest.mark.slow
def test_nf4_dequantize_matches_bitsandbytes():
    # a hard dependency (pyproject): a missing module or a moved reference decoder fails here, never skips silently
    import bitsandbytes.functional as bnbf
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    torch.manual_seed(0)
    for shape in [(64, 128), (32, 32), (100, 48), (7, 33)]:
        w = torch.randn(*shape) * 0.02
        for dq in (False, True):
            packed, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=dq, quant_type="nf4")
            ours = dequantize_nf4(packed, state)
            # reference: bitsandbytes' pure-torch decoder (its native CPU kernel is wrong when blocks cross rows)
            absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset if dq else state.absmax
            ref = _dequantize_4bit_compute(packed.reshape(-1), absmax.float(), state.code, 64, shape, torch.float32)
            assert torch.equal(ours, ref), (shape, dq)
            if shape[-1] % 64 == 0:
                assert torch.equal(ours, bnbf.dequantize_4bit(packed, state)), (shape, dq)
            assert (ours - w).abs().max() <= 0.2 * w.abs().max()  # half the widest nf4 gap is 0.14


def test_quantized_linear_names_skip_output_layer(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    names = quantized_linear_names(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert len(names) == 14 and "lm_head" not in names


# ----------------------------------------------------------------------------- failures and refusals


def test_impossible_tolerance_fails_and_marks_output(run_dir, tmp_path):
    out = tmp_path / "failed"
    out.mkdir()
    (out / "old.txt").write_text("replaced by --force")
    (out / EXPORT_INFO).write_text("{}")  # an earlier export: the only kind of directory --force replaces
    res = run_cli("export", run_dir, "--out", out, "--tolerance", "0", "--force")
    assert res.exit_code == 1, res.output
    assert "verification failed" in res.output and MARKER in res.output
    assert (out / MARKER).is_file() and (out / "config.json").is_file() and not (out / "old.txt").exists()
    assert "FAILED" in (out / "README.md").read_text()
    assert _no_leftovers(tmp_path) == []


def test_refuses_existing_output(run_dir, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = run_cli("export", run_dir, "--out", out)
    assert res.exit_code == 2 and "--force" in res.output
    assert (out / "keep.txt").read_text() == "mine"


def test_refuses_output_that_would_delete_the_run(run_dir):
    res = run_cli("export", run_dir, "--out", run_dir.parent, "--force")
    assert res.exit_code == 2 and "run directory" in res.output
    assert (run_dir / "adapter_config.json").is_file()


def test_refuses_missing_run_and_missing_adapter(run_dir, tmp_path):
    res = run_cli("export", tmp_path / "nope", "--out", tmp_path / "o")
    assert res.exit_code == 2 and "nope" in res.output and "does not exist" in res.output
    empty = tmp_path / "no_adapter"
    shutil.copytree(run_dir, empty, ignore=shutil.ignore_patterns("adapter_*"))
    res = run_cli("export", empty, "--out", tmp_path / "o")
    assert res.exit_code == 2 and "no_adapter" in res.output and "holds no adapter" in res.output
    assert not (tmp_path / "o").exists()


def test_refuses_bad_dtype(run_dir, tmp_path):
    res = run_cli("export", run_dir, "--out", tmp_path / "o", "--dtype", "int8")
    assert res.exit_code == 2 and "bfloat16" in res.output


def _other_base_run(run_dir: Path, tmp_path: Path, keep_architecture: bool) -> Path:
    other = save_tiny(tmp_path / "wider", hidden=48)
    run = tmp_path / "run_other"
    shutil.copytree(run_dir, run)
    info = json.loads((run / "delft_run.json").read_text())
    info["base_model"] = str(other)
    if not keep_architecture:
        del info["architecture"]  # e.g. a run from another tool: peft's own shape check must still refuse
    (run / "delft_run.json").write_text(json.dumps(info))
    return run


def test_refuses_adapter_of_another_base(run_dir, tmp_path):
    res = run_cli("export", _other_base_run(run_dir, tmp_path, True), "--out", tmp_path / "o")
    assert res.exit_code == 2 and "hidden_size 32 vs 48" in res.output, res.output
    res = run_cli("export", _other_base_run(run_dir, tmp_path / "b", False), "--out", tmp_path / "o")
    assert res.exit_code == 2 and "does not fit" in res.output, res.output
    assert not (tmp_path / "o").exists()


def test_refuses_when_disk_is_short(run_dir, tmp_path, monkeypatch):
    import delft.export.checks as export_checks

    monkeypatch.setattr(export_checks.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(UserError, match="not enough free disk space"):
        write_merged_model(run_dir, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_interrupted_export_leaves_nothing(run_dir, tmp_path, monkeypatch):
    import delft.export.merge as export

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "_check_files", boom)
    with pytest.raises(KeyboardInterrupt):
        write_merged_model(run_dir, tmp_path / "o")
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- small pieces


def test_eval_headline_and_gguf_wording(run_dir, tmp_path):
    rows = dict(eval_headline(run_dir))
    assert rows["run"] == "n 64, exact_match 43.8%, mae 3.5" and "digit_accuracy 50.0%" in rows["base"]
    assert eval_headline(tmp_path) == []
    short, detail, notes = _describe_merge({"quantization": "nf4"}, False, gguf=True)
    assert short == "dequantised GGUF" and "dequantised from GGUF" in detail and any("GGUF" in n for n in notes)
    short, detail, notes = _describe_merge({"quantization": "nf4"}, True, gguf=False)
    assert short == "nf4 round-trip" and "trained against" in detail and not notes


def test_the_free_space_check_counts_the_gguf_files(tmp_path, monkeypatch):
    """Room for the merged model alone is not room for it and its GGUF files (and a quantiser's 16-bit source)."""
    import delft.export.checks as export_checks
    from delft.export.checks import check_disk
    from delft.export.gguf import GgufPlan

    monkeypatch.setattr(export_checks.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 3 * 10**6))
    plan = GgufPlan(types=["f16", "q4_k_m"], lora=False, check=False, converter=tmp_path)
    assert plan.bytes_per_param == pytest.approx(2 + 0.62 + 2)
    assert check_disk(tmp_path / "o", 10**6, "bfloat16") == int(10**6 * 2 * 1.1)  # fits without GGUF
    with pytest.raises(UserError, match="for the GGUF files"):
        check_disk(tmp_path / "o", 10**6, "bfloat16", plan.bytes_per_param)
