"""delft.integrations.hf / .trl as a script uses them over a run: a resumed run logs what the uninterrupted one logs,
each checkpoint holds its digit-loss settings and a resume with others is refused, evaluate() reports the two parts
of eval_loss, and TRL's own TrlParser (command line and YAML) configures the loss through DigitSFTConfig."""

from __future__ import annotations

import json
import warnings

import pytest
from test_hf import EIGHT, collate, encode
from test_trl import ROWS
from tiny import build_model, build_tokenizer

from delft.integrations.digit_options import SETTINGS_FILE, DigitLossValueError

SPEC = {"type": "del", "weight": 0.5}
COMMON = {"per_device_train_batch_size": 2, "max_steps": 3, "logging_steps": 1, "save_strategy": "steps",
          "save_steps": 2, "report_to": [], "use_cpu": True, "learning_rate": 1e-2, "disable_tqdm": True, "seed": 3}


def hf(tok, out, spec=SPEC, **kw):
    from datasets import Dataset
    from transformers import TrainingArguments

    from delft.integrations.hf import DigitTrainer

    rows = encode(tok, EIGHT)
    return DigitTrainer(model=build_model(tok, hidden=32, layers=2), processing_class=tok, data_collator=collate,
                        args=TrainingArguments(output_dir=str(out), **COMMON), train_dataset=Dataset.from_list(rows),
                        eval_dataset=Dataset.from_list(rows[:5]), digit_loss=spec, **kw)


def sft(tok, out, spec=SPEC, config=None, **kw):
    from datasets import Dataset

    from delft.integrations.trl import DigitSFTConfig, DigitSFTTrainer

    args = config or DigitSFTConfig(output_dir=str(out), max_length=None, bf16=False, **COMMON)
    return DigitSFTTrainer(model=build_model(tok, hidden=32, layers=2), args=args, processing_class=tok,
                           train_dataset=Dataset.from_list(ROWS), eval_dataset=Dataset.from_list(ROWS[:5]),
                           digit_loss=spec, **kw)


BUILD = {"DigitTrainer": hf, "DigitSFTTrainer": sft}


def logs(trainer) -> dict:
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each trainer's uninterrupted 3-step run (checkpoints at steps 2 and 3), trained once for the module."""
    tok, out = build_tokenizer(), {}
    for name, build in BUILD.items():
        folder = tmp_path_factory.mktemp(name)
        trainer = build(tok, folder / "whole")
        trainer.train()
        out[name] = (folder, logs(trainer))
    return tok, out


@pytest.mark.parametrize("name", BUILD)
def test_a_resumed_run_logs_what_the_uninterrupted_run_logs(runs, name):
    tok, done = runs
    folder, whole = done[name]
    assert set(whole) == {1, 2, 3}
    resumed = BUILD[name](tok, folder / "resumed")
    resumed.train(resume_from_checkpoint=str(folder / "whole" / "checkpoint-2"))
    after = logs(resumed)  # steps 1 and 2 come from the checkpoint's trainer state
    assert set(after) == {1, 2, 3} and resumed.state.global_step == 3
    # step 3, the one step after the checkpoint, is divided by one step, not by the global step 3
    for key in ("loss", "ce", "digit_term", "digit_weight"):
        assert after[3][key] == pytest.approx(whole[3][key], rel=1e-5), (key, after[3], whole[3])
    assert after[3]["loss"] == pytest.approx(after[3]["ce"] + SPEC["weight"] * after[3]["digit_term"], rel=1e-4)


@pytest.mark.parametrize("name", BUILD)
def test_each_checkpoint_holds_its_digit_loss_settings(runs, name):
    _, done = runs
    folder, _ = done[name]
    for step in (2, 3):
        saved = json.loads((folder / "whole" / f"checkpoint-{step}" / SETTINGS_FILE).read_text())
        assert saved == {"type": "del", "weight": 0.5, "normalisation": "global", "place_weights": "reference",
                         "place_weight_cap": 10.0}


@pytest.mark.parametrize("resume", ["path", "last"])
@pytest.mark.parametrize("name", BUILD)
def test_a_resume_that_forgot_its_digit_loss_is_refused_before_training(runs, name, resume):
    """The script resumes without digit_loss= (del_prob 0.3 by default) from a checkpoint trained with del 0.5."""
    tok, done = runs
    folder, _ = done[name]
    whole = folder / "whole"
    before = {p: p.stat().st_mtime_ns for p in whole.rglob("*")}
    trainer = BUILD[name](tok, whole if resume == "last" else folder / "forgot", spec=None)
    with pytest.raises(DigitLossValueError) as err:
        trainer.train(resume_from_checkpoint=True if resume == "last" else str(whole / "checkpoint-2"))
    text = str(err.value)
    for words in ("resume_from_checkpoint=", "'type': 'del'", "'type': 'del_prob'", "digit_loss_resume_mismatch",
                  "differs in type, weight"):
        assert words in text, text
    assert isinstance(err.value, ValueError) and trainer.state.global_step == 0
    assert {p: p.stat().st_mtime_ns for p in whole.rglob("*")} == before  # nothing written, nothing trained
    assert not (folder / "forgot").exists() or not any((folder / "forgot").iterdir())


@pytest.mark.parametrize("name", BUILD)
def test_a_loss_changed_on_purpose_resumes_when_allowed(runs, name):
    tok, done = runs
    folder, _ = done[name]
    trainer = BUILD[name](tok, folder / "allowed", spec={"type": "del_prob", "weight": 0.2},
                          digit_loss_resume_mismatch="allow")
    trainer.train(resume_from_checkpoint=str(folder / "whole" / "checkpoint-2"))
    assert trainer.state.global_step == 3 and logs(trainer)[3]["digit_weight"] == 0.2
    saved = json.loads((folder / "allowed" / "checkpoint-3" / SETTINGS_FILE).read_text())
    assert (saved["type"], saved["weight"]) == ("del_prob", 0.2)  # the new settings, from here on


@pytest.mark.parametrize("name", BUILD)
def test_evaluate_reports_the_two_parts_of_eval_loss(runs, name, tmp_path):
    tok, _ = runs
    trainer = BUILD[name](tok, tmp_path, spec={"type": "del", "weight": 0.7})
    metrics = trainer.evaluate()
    assert {"eval_loss", "eval_ce", "eval_digit_term"} <= set(metrics), metrics
    assert metrics["eval_ce"] > 0 and metrics["eval_digit_term"] > 0
    assert metrics["eval_loss"] == pytest.approx(metrics["eval_ce"] + 0.7 * metrics["eval_digit_term"], rel=1e-5)
    ce_only = BUILD[name](tok, tmp_path, spec={"type": "ce"}).evaluate()  # the same model (seeded), CE alone
    assert ce_only["eval_loss"] == pytest.approx(metrics["eval_ce"], rel=1e-5)
    assert "eval_digit_term" not in ce_only  # CE alone has no term to report


# ------------------------------------------------------------------ TRL's parser and config files

def parse(argv: list[str]):
    from trl import TrlParser

    from delft.integrations.trl import DigitSFTConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        (config,) = TrlParser((DigitSFTConfig,)).parse_args_and_config(argv)
    return config


def test_trl_parser_command_line_switches_the_loss(tmp_path):
    tok = build_tokenizer()
    config = parse(["--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false", "--max_steps", "1",
                    "--report_to", "none", "--digit_loss_type", "dist2", "--digit_loss_weight", "0.4",
                    "--digit_loss_tau", "2.5", "--per_device_train_batch_size", "3", "--logging_steps", "1",
                    "--save_strategy", "no", "--max_length", "64"])
    trainer = sft(tok, tmp_path, spec=None, config=config)
    loss = trainer.digit_loss.loss
    assert (loss.type, loss.weight, loss.params) == ("dist2", 0.4, {"tau": 2.5})
    trainer.train()
    row = logs(trainer)[1]
    assert row["digit_weight"] == 0.4 and row["loss"] == pytest.approx(row["ce"] + 0.4 * row["digit_term"], rel=1e-4)


def test_a_trl_config_file_switches_the_loss(tmp_path):
    yaml_file = tmp_path / "sft.yaml"
    yaml_file.write_text(f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nbf16: false\nreport_to: none\n"
                         "digit_loss_type: ntl_was\ndigit_loss_weight: 0.25\ndigit_loss_resume_mismatch: allow\n")
    config = parse(["--config", str(yaml_file)])
    trainer = sft(build_tokenizer(), tmp_path, spec=None, config=config)
    assert (trainer.digit_loss.loss.type, trainer.digit_loss.loss.weight) == ("ntl_was", 0.25)
    assert trainer.digit_loss_resume_mismatch == "allow"


@pytest.mark.parametrize("argv, words", [
    (["--digit_loss_weight", "-1"], ["digit_loss_weight", "greater than or equal to 0", "got -1"]),
    (["--digit_loss_weight", "nan"], ["digit_loss_weight", "finite"]),
    (["--digit_loss_tau", "2"], ["digit_loss_tau only applies to type 'dist2'"]),
], ids=["negative", "nan", "tau_for_del_prob"])
def test_the_parser_refuses_a_bad_digit_loss_field(tmp_path, argv, words):
    with pytest.raises(DigitLossValueError) as err:
        parse(["--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false", *argv])
    assert all(w in str(err.value) for w in words), str(err.value)


def test_the_parser_names_the_loss_types_for_an_unknown_one(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(["--output_dir", str(tmp_path), "--use_cpu", "--digit_loss_type", "dell"])
    assert exit_.value.code == 2 and "del_prob" in capsys.readouterr().err


def test_digit_loss_and_config_fields_together_are_refused(tmp_path):
    from delft.integrations.trl import DigitSFTConfig

    config = DigitSFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, digit_loss_type="del")
    with pytest.raises(DigitLossValueError, match="in one place"):
        sft(build_tokenizer(), tmp_path, spec={"type": "del_prob"}, config=config)


# ------------------------------------------------------------------ digit_loss= said plainly

def bare(name: str, tmp_path, **kw):
    """The trainer without a model: a refusal of digit_loss comes before the Trainer looks at anything."""
    from transformers import TrainingArguments

    from delft.integrations.hf import DigitTrainer
    from delft.integrations.trl import DigitSFTConfig, DigitSFTTrainer

    if name == "DigitTrainer":
        return DigitTrainer(model=None, args=TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True), **kw)
    return DigitSFTTrainer(model=None, args=DigitSFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True,
                                                            bf16=False), **kw)


@pytest.mark.parametrize("spec, kind, words", [
    ({"weight": -1}, ValueError, ["digit_loss={'weight': -1}", "greater than or equal to 0", "got -1"]),
    ({"type": "del", "weight": float("nan")}, ValueError, ["weight", "finite number"]),
    ({"weight": float("inf")}, ValueError, ["weight", "finite number"]),
    ({"type": "del", "wieght": 0.3}, ValueError, ["wieght: unknown key; did you mean weight?", "accepted keys: type, "
                                                  "weight, tau, normalisation, place_weights, place_weight_cap"]),
    ("dell", ValueError, ["digit_loss='dell'", "'del_prob'", "got 'dell'"]),
    (["del", 0.3], TypeError, ["digit_loss=['del', 0.3] is a list", "digit_loss={'type': 'del_prob', 'weight': 0.3}",
                               "digit_loss='del_prob'"]),
    ({"type": "del"}, None, []),  # the resume option itself
], ids=["negative", "nan", "inf", "typo", "unknown_type", "list", "bad_resume_option"])
@pytest.mark.parametrize("name", BUILD)
def test_a_bad_digit_loss_is_refused_in_the_callers_words(tmp_path, name, spec, kind, words):
    from delft.errors import UserError

    extra = {} if kind else {"digit_loss_resume_mismatch": "ignore"}
    with pytest.raises(kind or ValueError) as err:
        bare(name, tmp_path, digit_loss=spec, **extra)
    text = str(err.value)
    assert all(w in text for w in words or ["digit_loss_resume_mismatch='ignore'", "'refuse', 'allow'"]), text
    assert isinstance(err.value, UserError) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", BUILD)
def test_a_type_name_is_a_digit_loss(tmp_path, name):
    trainer = BUILD[name](build_tokenizer(), tmp_path, spec="ntl_mse")
    assert (trainer.digit_loss.loss.type, trainer.digit_loss.loss.weight) == ("ntl_mse", 0.3)
