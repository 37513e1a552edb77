"""bitsandbytes on the CPU: the version floor (pyproject, `delft --version`, the refusal below it), the 8-bit AdamW
delft now runs there (against torch's AdamW; a real run; its states in the memory plan) and paged_adamw_8bit's
refusal."""

import json
import re

import pytest
import torch
from helpers import REPO, recipe_file, run_cli

from delft.models.loading import BNB_CPU_FLOOR, bitsandbytes_version
from delft.planning.memory import MIN_8BIT_SIZE, plan_memory
from delft.planning.shapes import QWEN2
from delft.recipe.files import load_recipe
from delft.recipe.schema import validate_recipe
from delft.training.stages import run_training


def test_pyproject_floor_is_the_version_delft_tested_on_the_cpu():
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(r'"bitsandbytes>=([\d.]+)"', text).group(1) == BNB_CPU_FLOOR
    assert f"bitsandbytes (>= {BNB_CPU_FLOOR})" in (REPO / "README.md").read_text()


@pytest.fixture
def old_bitsandbytes(tmp_path, monkeypatch):
    """An environment whose installed bitsandbytes (by its metadata, as pip records it) is 0.48.2."""
    info = tmp_path / "site" / "bitsandbytes-0.48.2.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bitsandbytes\nVersion: 0.48.2\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert bitsandbytes_version() == "0.48.2"


def test_version_names_the_installed_bitsandbytes():
    res = run_cli("--version")
    assert res.exit_code == 0 and f"bitsandbytes {bitsandbytes_version()}" in res.output


def test_below_the_floor_nf4_and_adamw_8bit_on_the_cpu_are_refused_in_one_paragraph(tmp_path, tiny_model_dir,
                                                                                  old_bitsandbytes):
    res = run_cli("--version")
    assert "bitsandbytes 0.48.2 (below 0.50.2" in res.output
    for name, sections in (("nf4", {"quantization": {"mode": "nf4"}}), ("eight", {"train": {"optimizer": "adamw_8bit"}})):
        path = recipe_file(tmp_path, tiny_model_dir, name=name, model={"name": str(tiny_model_dir), "device": "cpu"},
                           **sections)
        for command in (("recipe", "check"), ("train",)):
            res = run_cli(*command, path)
            assert res.exit_code == 2 and "Traceback" not in res.output, res.output
            assert f"needs bitsandbytes >= {BNB_CPU_FLOOR}" in res.output and "has bitsandbytes 0.48.2" in res.output
    assert not (tmp_path / "nf4").exists()  # refused before any run directory


def test_paged_adamw_8bit_on_the_cpu_is_refused_with_the_reason(tmp_path, tiny_model_dir):
    path = recipe_file(tmp_path, tiny_model_dir, train={"optimizer": "paged_adamw_8bit"})
    for command in (("recipe", "check"), ("train",)):
        res = run_cli(*command, path)
        assert res.exit_code == 2 and "runs it unpaged" in res.output and "adamw_8bit on the CPU" in res.output


def adam_steps(optimizer_of, steps: int = 30) -> tuple:
    """``steps`` of an optimizer on one 64 x 128 weight (8-bit states: above bitsandbytes' MIN_8BIT_SIZE) under a
    quadratic pull plus fixed noise: (start, end, the optimizer)."""
    torch.manual_seed(0)
    start, target = torch.randn(64, 128), torch.randn(64, 128)
    p = torch.nn.Parameter(start.clone())
    opt = optimizer_of([p])
    noise = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = ((p - target) ** 2).sum() + (p * torch.randn(64, 128, generator=noise)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return start, p.detach(), opt


def test_adamw_8bit_follows_torchs_adamw_on_the_cpu(tmp_path, tiny_model_dir):
    from delft.training.setup import build_optimizer, setup

    s = setup(load_recipe(recipe_file(tmp_path, tiny_model_dir, train={"optimizer": "adamw_8bit",
                                                                        "weight_decay": 0.01})))
    start, eight, opt = adam_steps(lambda params: build_optimizer(s, params, torch.float32))
    _, ref, _ = adam_steps(lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01))
    state = opt.state[opt.param_groups[0]["params"][0]]
    assert type(opt).__name__ == "AdamW8bit" and state["state1"].dtype == torch.uint8  # really 8-bit moments
    moved = (ref - start).norm()
    assert moved > 1  # 30 steps at 1e-2 moved the weight
    assert (eight - ref).norm() / moved < 0.05  # the 8-bit moments' rounding, not another optimizer


def test_adamw_8bit_trains_a_real_run_on_the_cpu(tmp_path, tiny_model_dir):
    run = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, train={"optimizer": "adamw_8bit",
                                                                                 "max_steps": 3})))
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(rows) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)


def test_the_plan_counts_8bit_states_and_bitsandbytes_fp32_states_of_small_tensors():
    def lora_bytes(r, optimizer):
        rec = validate_recipe({"model": {"dtype": "bfloat16"}, "quantization": {"mode": "nf4"},
                               "lora": {"r": r, "dropout": 0.0}, "train": {"optimizer": optimizer, "fused_loss": "off"}})
        return plan_memory(QWEN2["1.5b"], rec)["lora_optimizer"]

    # r=16 on Qwen2.5-1.5B: every LoRA tensor holds >= 16 x 256 = MIN_8BIT_SIZE elements, so all states are 8-bit
    assert 16 * 256 >= MIN_8BIT_SIZE
    saved = lora_bytes(16, "adamw") - lora_bytes(16, "adamw_8bit")
    params = (lora_bytes(16, "adamw") - lora_bytes(16, "sgd")) / 8
    assert saved == pytest.approx(params * (8 - 2 * (1 + 4 / 256)), rel=1e-9)
    # r=1: only gate's and up's B (8960 x 1) and down's A (1 x 8960) reach MIN_8BIT_SIZE; the others keep fp32 states
    saved = lora_bytes(1, "adamw") - lora_bytes(1, "adamw_8bit")
    assert saved == pytest.approx(28 * 3 * 8960 * (8 - 2 * (1 + 4 / 256)), rel=1e-9)
