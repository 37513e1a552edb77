"""What a Trainer or TRL user relies on keeps working under the digit trainers (issue 52, item 2), each checked
against transformers' Trainer and TRL's SFTTrainer on the same tiny random-init model: a mixture of experts' router
loss (a real tiny Mixtral), compute_metrics' logits, eval_loss's weighting of a smaller last batch, TRL's num_tokens,
the GRPO trainer's saved settings and its config, a DigitSFTConfig given to the stock trainer, the CE-only logs, a
missing processing_class and a reversed number form."""

from __future__ import annotations

import copy
import json
import warnings

import numpy as np
import pytest
import torch
from test_hf import EIGHT, collate, encode
from test_trl import ROWS
from tiny import build_model, build_tokenizer

from delft.integrations.digit_options import SETTINGS_FILE, DigitLossTypeError, DigitLossValueError

pytest.importorskip("trl")

COMMON = {"max_steps": 2, "logging_steps": 1, "report_to": [], "use_cpu": True, "save_strategy": "no",
          "disable_tqdm": True, "learning_rate": 1e-2, "seed": 0}
COEF = 0.5  # the Mixtral's router_aux_loss_coef


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def mixtral(tok):
    """A real tiny Mixtral (4 experts, 2 per token), random init, whose loss includes 0.5 x its router loss."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=COEF,
        output_router_logits=True, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
        max_position_embeddings=128))


def hf_pair(model, tok, spec, **args):
    """(transformers' Trainer, DigitTrainer) on copies of ``model``, the same rows (eight train, five eval)."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from delft.integrations.hf import DigitTrainer

    rows = encode(tok, EIGHT)
    kw = {"processing_class": tok, "data_collator": collate, "train_dataset": Dataset.from_list(rows),
          "eval_dataset": Dataset.from_list(rows[:5])}
    conf = {**COMMON, "per_device_train_batch_size": 2, "per_device_eval_batch_size": 2, **args}
    plain = Trainer(model=copy.deepcopy(model), args=TrainingArguments("/tmp/delft-lib-plain", **conf), **kw)
    ours = DigitTrainer(model=copy.deepcopy(model), args=TrainingArguments("/tmp/delft-lib-ours", **conf),
                        digit_loss=spec, **kw)
    return plain, ours


def sft_pair(model, tok, spec, **args):
    """(TRL's SFTTrainer, DigitSFTTrainer) on copies of ``model``, the same prompt-completion rows."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from delft.integrations.trl import DigitSFTTrainer

    kw = {"processing_class": tok, "train_dataset": Dataset.from_list(ROWS), "eval_dataset": Dataset.from_list(ROWS[:5])}
    conf = {**COMMON, "per_device_train_batch_size": 3, "per_device_eval_batch_size": 2, "max_length": None,
            "bf16": False, **args}
    plain = SFTTrainer(model=copy.deepcopy(model), args=SFTConfig("/tmp/delft-lib-plain", **conf), **kw)
    ours = DigitSFTTrainer(model=copy.deepcopy(model), args=SFTConfig("/tmp/delft-lib-ours", **conf),
                           digit_loss=spec, **kw)
    return plain, ours


def train_logs(trainer) -> list[dict]:
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


# ---------------------------------------------------------------------- a mixture of experts' router loss

def test_moe_router_loss_is_added_and_logged_as_transformers_trainer_adds_it(tok):
    plain, ours = hf_pair(mixtral(tok), tok, {"type": "del_prob", "weight": 0.0})
    want, got = train_logs(plain), train_logs(ours)
    assert len(want) == len(got) == 2
    for w, g in zip(want, got):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-6), (w, g)
        assert g["aux_loss"] > 0.5  # 4 experts, 2 per token: the balanced minimum is 2 x ... x 0.5 = 1
        assert g["loss"] == pytest.approx(g["ce"] + COEF * g["aux_loss"], rel=1e-5)  # the router loss is in it
    evals = plain.evaluate(), ours.evaluate()
    assert evals[1]["eval_loss"] == pytest.approx(evals[0]["eval_loss"], rel=1e-6)
    assert evals[1]["eval_loss"] == pytest.approx(evals[1]["eval_ce"] + COEF * evals[1]["eval_aux_loss"], rel=1e-6)


def test_moe_router_loss_is_added_and_logged_as_trl_sft_trainer_adds_it_with_accumulation(tok):
    # accumulation 2: the router loss is a mean per micro-batch, averaged over the step's micro-batches (TRL's way)
    plain, ours = sft_pair(mixtral(tok), tok, {"type": "del_prob", "weight": 0.0}, per_device_train_batch_size=2,
                           gradient_accumulation_steps=2)
    want, got = train_logs(plain), train_logs(ours)
    assert len(want) == len(got) == 2
    for w, g in zip(want, got):
        for key in ("loss", "aux_loss", "num_tokens", "entropy", "mean_token_accuracy"):
            assert g[key] == pytest.approx(w[key], rel=1e-6), (key, w, g)
        assert g["loss"] == pytest.approx(g["ce"] + COEF * g["aux_loss"], rel=1e-5)
    assert [g["num_tokens"] for g in got] == [w["num_tokens"] for w in want] and got[1]["num_tokens"] > got[0][
        "num_tokens"] > 0
    evals = plain.evaluate(), ours.evaluate()
    for key in ("eval_loss", "eval_aux_loss", "eval_num_tokens"):
        assert evals[1][key] == pytest.approx(evals[0][key], rel=1e-6), key


def test_a_weighted_digit_term_rides_on_top_of_the_router_loss(tok):
    _, ours = sft_pair(mixtral(tok), tok, {"type": "del_prob", "weight": 0.7}, max_steps=1)
    (log,) = train_logs(ours)
    assert log["digit_term"] > 0 and log["digit_weight"] == 0.7
    assert log["loss"] == pytest.approx(log["ce"] + 0.7 * log["digit_term"] + COEF * log["aux_loss"], rel=1e-5)


# ---------------------------------------------------------------------- compute_metrics, eval_loss's weights

def _metrics_of(store):
    def compute_metrics(pred):
        logits = pred.predictions[0] if isinstance(pred.predictions, tuple) else pred.predictions
        store["predictions"], store["labels"] = np.array(logits), np.array(pred.label_ids)
        return {"seen": float(np.asarray(logits).size)}
    return compute_metrics


@pytest.mark.parametrize("pair", [hf_pair, sft_pair], ids=["DigitTrainer", "DigitSFTTrainer"])
def test_compute_metrics_gets_the_plain_trainers_logits(tok, pair):
    plain, ours = pair(build_model(tok, hidden=32, layers=2), tok, {"type": "del_prob", "weight": 0.0})
    seen = {}, {}
    for trainer, store in zip((plain, ours), seen):
        trainer.compute_metrics = _metrics_of(store)
    metrics = plain.evaluate(), ours.evaluate()
    want, got = seen
    assert got["predictions"].shape == want["predictions"].shape
    rows, length, vocab = got["predictions"].shape
    assert rows == 5 and length > 1 and vocab == len(tok)  # (5, L, V), not (5, 0, V)
    np.testing.assert_allclose(got["predictions"], want["predictions"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got["labels"], want["labels"])
    assert metrics[1]["eval_seen"] == metrics[0]["eval_seen"] and metrics[1]["eval_loss"] == pytest.approx(
        metrics[0]["eval_loss"], rel=1e-6)


@pytest.mark.parametrize("pair", [hf_pair, sft_pair], ids=["DigitTrainer", "DigitSFTTrainer"])
def test_preprocess_logits_for_metrics_gets_them_too(tok, pair):
    plain, ours = pair(build_model(tok, hidden=32, layers=2), tok, {"type": "del_prob", "weight": 0.3})
    seen = {}, {}
    for trainer, store in zip((plain, ours), seen):
        trainer.compute_metrics = _metrics_of(store)
        trainer.preprocess_logits_for_metrics = lambda logits, labels: logits.argmax(-1)
    plain.evaluate(), ours.evaluate()
    assert seen[1]["predictions"].shape == seen[0]["predictions"].shape and seen[1]["predictions"].ndim == 2
    np.testing.assert_array_equal(seen[1]["predictions"], seen[0]["predictions"])


@pytest.mark.parametrize("pair", [hf_pair, sft_pair], ids=["DigitTrainer", "DigitSFTTrainer"])
def test_eval_parts_weigh_a_smaller_last_batch_as_eval_loss_does(tok, pair):
    # 5 eval rows at eval batch 2: batches of 2, 2 and 1 row, weighed 2:2:1 by the Trainer's loop
    model = build_model(tok, hidden=32, layers=2)
    plain, zero = pair(model, tok, {"type": "del_prob", "weight": 0.0})
    want, got = plain.evaluate(), zero.evaluate()
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-6)
    assert got["eval_ce"] == pytest.approx(got["eval_loss"], rel=1e-6)
    _, weighted = pair(model, tok, {"type": "del_prob", "weight": 0.7})
    m = weighted.evaluate()
    assert m["eval_digit_term"] > 0 and m["eval_ce"] == pytest.approx(got["eval_ce"], rel=1e-6)
    assert m["eval_loss"] == pytest.approx(m["eval_ce"] + 0.7 * m["eval_digit_term"], rel=1e-6)


# ---------------------------------------------------------------------- configs the stock trainers must not take

def test_digit_sft_config_given_to_trls_sft_trainer_is_refused(tok):
    from datasets import Dataset
    from trl import SFTTrainer

    from delft.integrations.hf import DigitTrainer
    from delft.integrations.trl import DigitSFTConfig, DigitSFTTrainer

    config = DigitSFTConfig("/tmp/delft-lib-cfg", digit_loss_weight=3.0, bf16=False, max_length=None, **COMMON)
    ds = Dataset.from_list(ROWS)
    for stock in (SFTTrainer, DigitTrainer):  # DigitTrainer does not read the fields either
        with pytest.raises(DigitLossTypeError) as err:
            stock(model=build_model(tok), args=config, train_dataset=ds, processing_class=tok)
        assert "DigitSFTConfig" in str(err.value) and "DigitSFTTrainer" in str(err.value)
    trainer = DigitSFTTrainer(model=build_model(tok), args=config, train_dataset=ds, processing_class=tok)
    assert trainer.digit_loss.loss.weight == 3.0  # the same config object, afterwards, in the trainer it is for
    with pytest.raises(DigitLossTypeError):
        SFTTrainer(model=build_model(tok), args=config, train_dataset=ds, processing_class=tok)


# ---------------------------------------------------------------------- small things the logs and errors say

def test_ce_alone_logs_no_digit_term_nor_weight(tok):
    _, ours = hf_pair(build_model(tok), tok, {"type": "ce"}, max_steps=1)
    (log,) = train_logs(ours)
    assert log["ce"] == pytest.approx(log["loss"], rel=1e-6)
    assert not {"digit_term", "digit_weight"} & set(log), log
    metrics = ours.evaluate()
    assert "eval_ce" in metrics and "eval_digit_term" not in metrics


def test_delfts_dft_type_under_digit_sft_trainer_is_trls_dft(tok):
    plain, ours = sft_pair(build_model(tok), tok, {"type": "dft"}, max_steps=1)
    plain.args.loss_type = "dft"  # TRL's own DFT on the plain trainer; delft's type alone on ours
    want, got = train_logs(plain), train_logs(ours)
    assert got[0]["loss"] == pytest.approx(want[0]["loss"], rel=1e-6) and "digit_weight" not in got[0]
    _, nll = sft_pair(build_model(tok), tok, {"type": "ce"}, max_steps=1)
    assert train_logs(nll)[0]["loss"] > got[0]["loss"] * 1.5  # DFT, not CE: p < 1 shrinks every label's term


@pytest.mark.parametrize("name", ["DigitTrainer", "DigitSFTTrainer"])
def test_a_missing_processing_class_is_named(tok, name):
    from datasets import Dataset
    from transformers import TrainingArguments

    from delft.integrations.hf import DigitTrainer
    from delft.integrations.trl import DigitSFTTrainer

    if name == "DigitTrainer":
        build = lambda: DigitTrainer(model=build_model(tok), args=TrainingArguments("/tmp/delft-lib-x", **COMMON),
                                     train_dataset=Dataset.from_list(encode(tok, EIGHT)), data_collator=collate,
                                     digit_loss="del")
    else:  # TRL needs a tokenizer for its own work: handed over, then gone (set to None) before the loss is built
        trainer = DigitSFTTrainer(model=build_model(tok), processing_class=tok, train_dataset=Dataset.from_list(ROWS),
                                  args=__import__("trl").SFTConfig("/tmp/delft-lib-x", bf16=False, **COMMON))
        trainer.processing_class = None
        build = lambda: trainer.configure_digit_loss({"type": "del"})
    with pytest.raises(DigitLossValueError) as err:
        build()
    assert "processing_class" in str(err.value) and "processing_class=tokenizer" in str(err.value.fix)
    assert "vocab=NumberVocab" not in str(err.value)


def test_a_reversed_number_form_gives_each_digit_its_true_place(tok):
    import torch.nn.functional as F

    from delft.losses.modules import DigitLoss
    from delft.numbers.tokens import NumberVocab
    from delft.recipe.schema import NumbersConfig

    reversed_rows = [t.split("A: ")[0] + "A: " + t.split("A: ")[1][::-1] for t in EIGHT]  # the answers reversed
    model = build_model(tok, hidden=32, layers=2)
    losses = {}
    for form in (None, {"order": "reversed"}):
        _, trainer = hf_pair(model, tok, {"type": "del", "weight": 0.5, **({"numbers": form} if form else {})})
        batch = collate(encode(tok, reversed_rows[:4]))
        trainer.model.eval()
        losses[str(form)] = float(trainer.compute_loss(trainer.model, batch))
    vocab = NumberVocab.from_tokenizer(tok).written_as(NumbersConfig(order="reversed"))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    oracle = float(DigitLoss(tok, "del", 0.5, vocab=vocab)(logits, batch["labels"][:, 1:]))
    assert losses[str({"order": "reversed"})] == pytest.approx(oracle, rel=1e-5)
    assert abs(losses["None"] - oracle) > 1e-4  # natural places on reversed digits: another loss
    ce = F.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
    assert oracle > float(ce)  # the term is in it


def test_digit_sft_config_takes_the_number_form(tok):
    from datasets import Dataset

    from delft.integrations.trl import DigitSFTConfig, DigitSFTTrainer

    config = DigitSFTConfig("/tmp/delft-lib-cfg", digit_loss_number_order="reversed", digit_loss_count_prefix=True,
                            bf16=False, max_length=None, **COMMON)
    trainer = DigitSFTTrainer(model=build_model(tok), args=config, train_dataset=Dataset.from_list(ROWS),
                              processing_class=tok)
    vocab = trainer.digit_loss.vocab
    assert (vocab.order, vocab.count_prefix) == ("reversed", True)
    assert trainer._digit_options["numbers"] == {"order": "reversed", "count_prefix": True}


# ---------------------------------------------------------------------- GRPO: settings saved, its config

def _grpo(model_dir, out, cls=None, **extra):
    from datasets import Dataset
    from test_grpo import rows
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from delft.integrations.grpo import DigitGRPOConfig, DigitGRPOTrainer
    from delft.numbers.rewards import exact_reward

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = extra.pop("args", None) or DigitGRPOConfig(
        output_dir=str(out), per_device_train_batch_size=4, num_generations=2, max_completion_length=4, max_steps=2,
        logging_steps=1, report_to=[], bf16=False, use_cpu=True, seed=0, save_strategy="steps", save_steps=1,
        disable_tqdm=True, beta=0.0)
    return (cls or DigitGRPOTrainer)(model=AutoModelForCausalLM.from_pretrained(model_dir), args=config,
                                     train_dataset=Dataset.from_list(rows(tokenizer, 4)), processing_class=tokenizer,
                                     reward_funcs=[exact_reward], **extra)


@pytest.mark.slow
def test_grpo_checkpoints_hold_the_auxiliary_settings_and_a_resume_without_them_is_refused(tiny_model_dir, tmp_path):
    first = _grpo(tiny_model_dir, tmp_path / "run", aux_mu=0.9, aux_mu_end=0.05,
                  digit_loss={"type": "del_prob", "weight": 0.3})
    first.train()
    ckpt = tmp_path / "run" / "checkpoint-1"
    saved = json.loads((ckpt / SETTINGS_FILE).read_text())
    assert saved["aux_mu"] == 0.9 and saved["aux_mu_end"] == 0.05 and saved["type"] == "del_prob"
    forgot = _grpo(tiny_model_dir, tmp_path / "again")  # aux_mu forgotten: plain GRPO
    with pytest.raises(DigitLossValueError) as err:
        forgot.train(resume_from_checkpoint=str(ckpt))
    assert "aux_mu" in str(err.value) and "digit_loss_resume_mismatch='allow'" in err.value.fix
    assert not list((tmp_path / "again").glob("checkpoint-*"))  # refused before a step was trained
    same = _grpo(tiny_model_dir, tmp_path / "same", aux_mu=0.9, aux_mu_end=0.05,
                 digit_loss={"type": "del_prob", "weight": 0.3})
    same.train(resume_from_checkpoint=str(ckpt))
    assert same.state.global_step == 2


def test_digit_grpo_config_sets_the_auxiliary_term_and_trls_grpo_trainer_refuses_it(tiny_model_dir, tmp_path):
    from trl import GRPOTrainer

    from delft.integrations.grpo import DigitGRPOConfig

    config = DigitGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                             max_completion_length=4, max_steps=1, report_to=[], bf16=False, use_cpu=True,
                             aux_mu=0.9, aux_mu_end=0.05, digit_loss_type="del", digit_loss_weight=0.1)
    trainer = _grpo(tiny_model_dir, tmp_path, args=config)
    assert (trainer.aux_mu, trainer.aux_mu_end) == (0.9, 0.05)
    assert trainer.digit_loss.loss.type == "del" and trainer.digit_loss.loss.weight == 0.1
    with pytest.raises(DigitLossValueError):  # the weight in two places
        _grpo(tiny_model_dir, tmp_path, args=config, aux_mu=0.5)
    with pytest.raises(DigitLossTypeError) as err:
        _grpo(tiny_model_dir, tmp_path, cls=GRPOTrainer, args=config)
    assert "DigitGRPOConfig" in str(err.value) and "DigitGRPOTrainer" in str(err.value)
    with pytest.raises(DigitLossValueError):
        DigitGRPOConfig(output_dir=str(tmp_path), aux_mu=-1.0, use_cpu=True)
