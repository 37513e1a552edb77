"""Misuse of the library said plainly (issue 37, item 3): the real transformers Trainer, TRL's real SFTTrainer and
GRPOTrainer and axolotl's plugin hook, on tiny random-init models, each given the mistake a user makes; each
refusal comes at construction, before a step, as one UserError naming the mistake and the fix in the caller's
own words."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from helpers import extra_missing
from tiny import build_model, build_tokenizer

from delft.errors import UserError
from delft.numbers.tokens import NumberVocab

TEXTS = [f"Q: {a} + {b} =\nA: {a + b}" for a, b in ((1, 2), (45, 67), (100, 23), (9, 9), (1234, 5), (7, 70))]
SFT_ROWS = [{"prompt": t.split("A: ")[0] + "A: ", "completion": t.split("A: ")[1]} for t in TEXTS]


def encode(tok, texts=TEXTS, mask_answers: bool = False):
    """Rows with the prompt masked; ``mask_answers``: the mistake, labels that keep only the prompt."""
    rows = []
    for t in texts:
        prompt, answer = t.split("A: ")
        p, a = tok.encode(prompt + "A: ", add_special_tokens=False), tok.encode(answer, add_special_tokens=False)
        labels = p + [-100] * len(a) if mask_answers else [-100] * len(p) + a
        rows.append({"input_ids": p + a, "labels": labels})
    return rows


def collate(rows):
    width = max(len(r["input_ids"]) for r in rows)
    pad = [width - len(r["input_ids"]) for r in rows]
    return {"input_ids": torch.tensor([r["input_ids"] + [0] * p for r, p in zip(rows, pad)]),
            "labels": torch.tensor([r["labels"] + [-100] * p for r, p in zip(rows, pad)]),
            "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * p for r, p in zip(rows, pad)])}


def hf_trainer(model, tok, rows=None, steps: int = 1, digit_loss=None, **args):
    from datasets import Dataset
    from transformers import TrainingArguments

    from delft.integrations.hf import DigitTrainer

    config = TrainingArguments(output_dir="/tmp/delft-misuse-hf", per_device_train_batch_size=2, max_steps=steps,
                               logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                               **args)
    return DigitTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows or encode(tok)),
                        data_collator=collate, processing_class=tok,
                        digit_loss=digit_loss if digit_loss is not None else {"type": "del_prob", "weight": 0.3})


def sft_trainer(model, tok, digit_loss=None, **config):
    from datasets import Dataset
    from trl import SFTConfig

    from delft.integrations.trl import DigitSFTTrainer

    args = SFTConfig(**{"output_dir": "/tmp/delft-misuse-trl", "per_device_train_batch_size": 3, "max_steps": 1,
                        "report_to": [], "use_cpu": True, "save_strategy": "no", "disable_tqdm": True,
                        "bf16": False, "max_length": None, **config})
    return DigitSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(SFT_ROWS), processing_class=tok,
                           digit_loss=digit_loss if digit_loss is not None else {"type": "del_prob", "weight": 0.3})


@pytest.fixture
def tok():
    return build_tokenizer()


# ----------------------------------------------------------------------------- the model and its tokenizer


def test_a_model_without_an_output_layer_is_refused_at_construction(tok):
    body = build_model(tok).model  # LlamaModel: what AutoModel.from_pretrained gives
    with pytest.raises(UserError) as err:
        hf_trainer(body, tok)
    msg = str(err.value)
    assert "DigitTrainer got LlamaModel" in msg and "without an output layer" in msg
    assert "AutoModelForCausalLM" in msg and "LlamaForCausalLM" in msg


def test_a_tokenizer_whose_number_tokens_pass_the_output_rows_is_refused_at_construction(tok):
    model = build_model(tok)  # rows: the character tokenizer's vocabulary
    chunked = build_tokenizer(chunked_digits=True)  # the same characters plus 100 two-digit tokens past those rows
    rows = model.get_output_embeddings().weight.shape[0]
    assert max(NumberVocab.from_tokenizer(chunked).ids) >= rows
    with pytest.raises(UserError) as err:
        hf_trainer(model, chunked, rows=encode(tok))
    msg = str(err.value)
    assert f"has {rows} rows" in msg and "not this model's" in msg and "resize_token_embeddings" in msg
    assert "processing_class" in msg


def _glued_digit_trainer(tok):
    return hf_trainer(build_model(tok), tok)


def _glued_sft_trainer(tok):
    return sft_trainer(build_model(tok), tok)


def _glued_digit_loss(tok):
    from delft.losses.modules import DigitLoss

    return DigitLoss(tok, "del_prob")


@pytest.mark.parametrize("build, words", [
    (_glued_digit_trainer, 'pass digit_loss={"type": "ce"} to DigitTrainer'),
    (_glued_sft_trainer, 'pass digit_loss={"type": "ce"} to DigitSFTTrainer'),
    (_glued_digit_loss, "DigitLoss(tokenizer, type='ce')"),
])
def test_a_glued_digit_tokenizer_is_refused_in_the_callers_words(build, words):
    glued = build_tokenizer(glued_digits=True)  # " 7" is one token, as GPT-2 writes numbers
    with pytest.raises(UserError) as err:
        build(glued)
    msg = str(err.value)
    assert "glued to other characters" in msg and words in msg
    assert "loss.type" not in msg  # recipe words are for the CLI


@pytest.mark.skipif(bool(extra_missing("axolotl")), reason=str(extra_missing("axolotl")))
def test_axolotls_plugin_refuses_a_glued_tokenizer_in_yaml_words():
    from axolotl.utils.dict import DictDefault

    from delft.integrations.axolotl import DigitLossPlugin

    glued = build_tokenizer(glued_digits=True)
    trainer = hf_trainer(build_model(glued), glued, digit_loss={"type": "ce"})  # CE alone: builds
    with pytest.raises(UserError) as err:
        DigitLossPlugin().post_trainer_create(DictDefault({"digit_loss": {"type": "del_prob"}}), trainer)
    msg = str(err.value)
    assert "glued to other characters" in msg and "set type: ce under digit_loss: in the axolotl config" in msg
    assert "loss.type" not in msg and "digit_loss={" not in msg


def test_ntloss_registering_the_digits_as_added_tokens_leaves_the_number_tokens(tok):
    ntloss = pytest.importorskip("ntloss")
    before = NumberVocab.from_tokenizer(tok)
    ntloss.NTLoss(tok)  # registers '0'..'9' as added tokens on this very tokenizer, ids unchanged
    assert {str(t) for t in tok.added_tokens_decoder.values()} >= set("0123456789")
    assert NumberVocab.from_tokenizer(tok) == before
    trainer = hf_trainer(build_model(tok), tok)
    assert trainer.digit_loss.vocab == before


def test_ntloss_on_a_chunked_tokenizer_gives_the_digits_it_now_writes():
    ntloss = pytest.importorskip("ntloss")
    chunked = build_tokenizer(chunked_digits=True)
    assert NumberVocab.from_tokenizer(chunked).max_len == 2
    ntloss.NTLoss(chunked)  # added single digits split every number: "1234" is 1 | 2 | 3 | 4 now
    vocab = NumberVocab.from_tokenizer(chunked)
    assert vocab.is_single_digit and [vocab.text_of(t) for t in chunked.encode("1234")] == list("1234")


# ----------------------------------------------------------------------------- the labels


WORDED = [f"Q: what is {a} plus {b}?\nA: {n}" for a, b, n in (("one", "two", 3), ("ten", "five", 15),
                                                               ("six", "six", 12), ("nine", "one", 10))]


@pytest.mark.parametrize("mistake, seen_words", [
    ("prompt_only", "not one of them a digit"),  # labels = the prompt: the answers' digits masked
    ("all_masked", "every label was -100"),
])
def test_labels_without_a_digit_for_the_first_steps_warn_once(tok, mistake, seen_words):
    rows = encode(tok, WORDED, mask_answers=True)
    if mistake == "all_masked":
        rows = [{"input_ids": r["input_ids"], "labels": [-100] * len(r["labels"])} for r in rows]
    trainer = hf_trainer(build_model(tok), tok, rows=rows, steps=5)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    ours = [str(w.message) for w in seen if "digit term" in str(w.message)]
    assert len(ours) == 1, ours  # once, though all five steps had no digit
    assert "DigitTrainer: the first 3 optimizer steps" in ours[0] and seen_words in ours[0]
    assert "digit characters the labels mask out" in ours[0] and "-100" in ours[0] and "del_prob" in ours[0]


def test_labels_with_digits_do_not_warn(tok):
    trainer = hf_trainer(build_model(tok), tok, steps=3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in seen if "digit term" in str(w.message)]


# ----------------------------------------------------------------------------- TRL's own loss options


def test_trls_dft_loss_type_is_applied_as_trl_applies_it(tok):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model = build_model(tok)
    ours = sft_trainer(copy.deepcopy(model), tok, digit_loss={"type": "ce"}, loss_type="dft")
    args = SFTConfig(output_dir="/tmp/delft-misuse-trl-plain", per_device_train_batch_size=3, max_steps=1,
                     report_to=[], use_cpu=True, bf16=False, max_length=None, loss_type="dft", save_strategy="no")
    plain = SFTTrainer(model=copy.deepcopy(model), args=args, train_dataset=Dataset.from_list(SFT_ROWS),
                       processing_class=tok)
    batch = next(iter(ours.get_train_dataloader()))
    ours.model.eval(), plain.model.eval()  # no step counts: both normalise by this batch's own label count
    with torch.no_grad():
        dft, theirs = ours.compute_loss(ours.model, batch), plain.compute_loss(plain.model, batch)
        nll = sft_trainer(copy.deepcopy(model), tok, digit_loss={"type": "ce"}).compute_loss(ours.model, batch)
    assert torch.allclose(dft, theirs, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(dft, nll)  # DFT is not plain NLL, so the comparison above could fail


@pytest.mark.parametrize("options, words", [
    ({"label_smoothing_factor": 0.1}, "does not apply label_smoothing_factor 0.1"),
])
def test_sft_options_the_digit_loss_would_replace_are_refused(tok, options, words):
    with pytest.raises(UserError) as err:
        sft_trainer(build_model(tok), tok, **options)
    assert words in str(err.value) and "DigitSFTTrainer" in str(err.value)


def test_a_compute_loss_func_the_digit_loss_would_replace_is_refused(tok):
    from datasets import Dataset
    from transformers import TrainingArguments

    from delft.integrations.hf import DigitTrainer

    args = TrainingArguments(output_dir="/tmp/delft-misuse-hf", max_steps=1, report_to=[], use_cpu=True,
                             save_strategy="no")
    with pytest.raises(UserError) as err:
        DigitTrainer(model=build_model(tok), args=args, train_dataset=Dataset.from_list(encode(tok)),
                     data_collator=collate, processing_class=tok, compute_loss_func=lambda *a, **k: 0.0)
    assert "compute_loss_func" in str(err.value) and "would never run" in str(err.value)


# ----------------------------------------------------------------------------- GRPO


def grpo_trainer(model_dir, tmp_path, dataset, rewards=None, **extra):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from delft.integrations.grpo import DigitGRPOTrainer
    from delft.numbers.rewards import exact_reward

    def varied(completions, **kwargs):  # a random-init model is never right: a reward that varies
        return [float(len(set(c))) for c in completions]

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, max_steps=1, learning_rate=1e-2, beta=0.0, logging_steps=1,
                      report_to=[], bf16=False, use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True)
    return DigitGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args,
                            train_dataset=dataset(tokenizer) if callable(dataset) else dataset,
                            processing_class=tokenizer, reward_funcs=rewards or [exact_reward, varied], **extra)


def trl_rows(n=4):
    return [{"prompt": f"What is {10 + i} + {i}?\n", "completion": f"{10 + 2 * i}", "answer": f"{10 + 2 * i}"}
            for i in range(n)]


def test_grpos_auxiliary_term_without_gold_columns_is_refused_at_construction(tiny_model_dir, tmp_path):
    from datasets import Dataset

    with pytest.raises(UserError) as err:
        grpo_trainer(tiny_model_dir, tmp_path, Dataset.from_list(trl_rows()), aux_mu=0.5)
    msg = str(err.value)
    assert "'gold_input_ids', 'gold_labels'" in msg and "auxiliary term" in msg
    assert "add_gold_columns(dataset, tokenizer)" in msg and "aux_mu=0" in msg
    grpo_trainer(tiny_model_dir, tmp_path, Dataset.from_list(trl_rows()), aux_mu=0.0)  # GRPO alone needs none


def test_grpos_rewards_without_their_answer_column_are_refused_at_construction(tiny_model_dir, tmp_path):
    from datasets import Dataset

    from delft.numbers.rewards import digit_reward

    rows = [{k: v for k, v in r.items() if k != "answer"} | {"final": r["answer"]} for r in trl_rows()]
    with pytest.raises(UserError) as err:
        grpo_trainer(tiny_model_dir, tmp_path, Dataset.from_list(rows), rewards=[digit_reward])
    msg = str(err.value)
    assert "no column 'answer'" in msg and "reward 'digits'" in msg and "answer_column" in msg


def test_add_gold_columns_and_answer_column_train_a_grpo_step(tiny_model_dir, tmp_path):
    from datasets import Dataset

    from delft.integrations.grpo import add_gold_columns
    from delft.numbers.rewards import digit_reward, exact_reward

    rows = [{k: v for k, v in r.items() if k != "answer"} | {"final": r["answer"]} for r in trl_rows()]
    trainer = grpo_trainer(
        tiny_model_dir, tmp_path, lambda tk: add_gold_columns(Dataset.from_list(rows), tk, max_length=64),
        rewards=[functools.partial(exact_reward, answer_column="final"),
                 functools.partial(digit_reward, answer_column="final")],
        aux_mu=0.5, digit_loss={"type": "del_prob", "weight": 0.3})
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "aux/ce" in h)
    assert logged["aux/ce"] > 0 and "rewards/exact/mean" in logged and "rewards/digits/mean" in logged


def test_add_gold_columns_masks_exactly_the_prompt_as_trl_tokenises_it(tiny_tokenizer):
    from delft.integrations.grpo import gold_ids

    plain = gold_ids(tiny_tokenizer, "What is 2 + 3?\n", "5")
    n_prompt = len(tiny_tokenizer(text="What is 2 + 3?\n")["input_ids"])
    assert plain["gold_labels"][:n_prompt] == [-100] * n_prompt
    assert tiny_tokenizer.decode(plain["gold_input_ids"][n_prompt:]) == "5" + tiny_tokenizer.eos_token
    assert plain["gold_labels"][n_prompt:] == plain["gold_input_ids"][n_prompt:]
    chat = gold_ids(tiny_tokenizer, [{"role": "user", "content": "2 + 3?"}],
                    [{"role": "assistant", "content": "5"}])
    shown = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "2 + 3?"}], tokenize=False,
                                               add_generation_prompt=True)
    kept = [t for t in chat["gold_labels"] if t != -100]
    assert tiny_tokenizer.decode(chat["gold_input_ids"]).startswith(shown)
    assert tiny_tokenizer.decode(kept) == "5</s>\n"  # the assistant's turn and its end, as the template writes it
    assert len(gold_ids(tiny_tokenizer, "What is 2 + 3?\n", "5" * 50, max_length=20)["gold_input_ids"]) == 20


def test_an_iterable_dataset_without_gold_columns_is_refused_at_its_first_batch_before_generating(tiny_model_dir,
                                                                                                  tmp_path):
    from datasets import IterableDataset

    from delft.numbers.rewards import exact_reward

    scored = []

    def watch(completions, **kwargs):  # TRL calls rewards after generating: a call means generation ran
        scored.append(len(completions))
        return [0.0] * len(completions)

    stream = IterableDataset.from_generator(trl_rows)  # no features: the columns are unknown at construction
    assert stream.column_names is None
    trainer = grpo_trainer(tiny_model_dir, tmp_path, stream, rewards=[exact_reward, watch], aux_mu=0.5)
    with pytest.raises(UserError) as err:
        trainer.train()
    msg = str(err.value)
    assert "a batch of train_dataset has no column 'gold_input_ids', 'gold_labels'" in msg and "add_gold_columns" in msg
    assert scored == []  # refused before any completion was generated


def test_grpo_refuses_a_glued_digit_tokenizer_in_its_own_words(tmp_path):
    from datasets import Dataset
    from tiny import save_tiny

    glued = save_tiny(tmp_path / "glued", glued_digits=True)
    with pytest.raises(UserError) as err:
        grpo_trainer(glued, tmp_path, Dataset.from_list(trl_rows()), digit_loss={"type": "del_prob"})
    msg = str(err.value)
    assert "glued to other characters" in msg and 'pass digit_loss={"type": "ce"} to DigitGRPOTrainer' in msg
    assert "loss.type" not in msg
