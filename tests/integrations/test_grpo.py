"""delft.integrations.grpo.DigitGRPOTrainer against TRL's real GRPOTrainer, on a tiny random-init model: with
mu = 0 it is TRL's trainer, and its auxiliary term is delft's SFT loss on the same gold batch."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")


def rows(tokenizer, n=8):
    from delft.data.sources import Example
    from delft.data.batches import tokenize_example
    from delft.recipe.schema import DataConfig

    cfg = DataConfig(template="plain", max_length=64)
    out = []
    for i in range(n):
        a, b = 11 + 7 * i, 5 + 3 * i
        ex = Example(f"What is {a} + {b}?\n", str(a + b), str(a + b), i)
        tok = tokenize_example(ex, tokenizer, cfg)
        out.append({"prompt": ex.prompt, "answer": ex.answer, "gold_input_ids": tok.input_ids,
                    "gold_labels": tok.labels})
    return out


def trainer(cls, model_dir, tmp_path, **extra):
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from delft.numbers.rewards import digit_reward, exact_reward

    def varied(completions, **kwargs):  # a random-init model is never right: a reward that varies, to move it
        return [float(len(set(c))) for c in completions]

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2,
                      gradient_accumulation_steps=2, max_completion_length=4, max_steps=2, learning_rate=5e-2,
                      beta=0.0, logging_steps=1, report_to=[], bf16=False, use_cpu=True, seed=0, save_strategy="no",
                      reward_weights=[1.0, 0.2, 1.0], multi_objective_aggregation="normalize_then_sum",
                      temperature=1.0, disable_tqdm=True)
    return cls(model=model, args=args, train_dataset=Dataset.from_list(rows(tokenizer)), processing_class=tokenizer,
               reward_funcs=[exact_reward, digit_reward, varied], **extra)


def lora_weights(t):
    return {k: v.detach().clone() for k, v in t.model.named_parameters() if "lora_" in k}


@pytest.mark.slow
def test_with_mu_zero_it_is_trls_grpo_trainer(tiny_model_dir, tmp_path):
    import torch
    from trl import GRPOTrainer

    from delft.integrations.grpo import DigitGRPOTrainer

    plain = trainer(GRPOTrainer, tiny_model_dir, tmp_path / "a")
    plain.train()
    ours = trainer(DigitGRPOTrainer, tiny_model_dir, tmp_path / "b", aux_mu=0.0,
                   digit_loss={"type": "del_prob", "weight": 0.3})
    ours.train()
    a, b = lora_weights(plain), lora_weights(ours)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in a.items() if "lora_B" in k)  # it trained
    with_aux = trainer(DigitGRPOTrainer, tiny_model_dir, tmp_path / "c", aux_mu=0.5,
                       digit_loss={"type": "del_prob", "weight": 0.3})
    with_aux.train()
    c = lora_weights(with_aux)
    assert any(not torch.equal(a[k], c[k]) for k in a)  # the auxiliary term moves the model
    logged = [h for h in with_aux.state.log_history if "aux/ce" in h]
    assert len(logged) == 2 and all(h["aux/mu"] == 0.5 and h["aux/ce"] > 0 for h in logged)
    assert all("rewards/exact/mean" in h and "rewards/digits/mean" in h for h in logged)


def test_the_auxiliary_term_is_delfts_sft_loss_on_the_gold_batch(tiny_model_dir, tmp_path):

    from delft.data.batches import Tokenized, collate
    from delft.integrations.grpo import DigitGRPOTrainer
    from delft.losses.modules import DigitLoss

    t = trainer(DigitGRPOTrainer, tiny_model_dir, tmp_path, aux_mu=1.0,
                digit_loss={"type": "del_prob", "weight": 0.3})
    gold = t.gold_batch(rows(t.processing_class, 7))  # 7 prompts over 2 micro-steps: 3 and 4
    assert [p["input_ids"].shape[0] for p in gold.parts] == [3, 4]
    model = t.model
    model.train()
    ours = sum(t.aux_loss(model, part, gold.counts)[0] for part in gold.parts)
    batch = collate([Tokenized(r["gold_input_ids"], r["gold_labels"]) for r in rows(t.processing_class, 7)],
                    t.processing_class.pad_token_id)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    reference = DigitLoss(t.processing_class, "del_prob", 0.3)(logits[:, :-1].float(), batch["labels"][:, 1:])
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)
    assert gold.counts.digits > 0 and gold.counts.labels > gold.counts.digits


def test_mu_decays_linearly_over_the_run():
    from delft.integrations.grpo import mu_at

    assert mu_at(0, 10, 0.9, 0.05) == 0.9 and mu_at(9, 10, 0.9, 0.05) == pytest.approx(0.05)
    assert mu_at(5, 10, 0.3, None) == 0.3


@pytest.mark.parametrize("extra, words", [
    ({"aux_mu": -0.5}, ["aux_mu=-0.5", "finite number >= 0"]),
    ({"aux_mu": float("nan")}, ["aux_mu=nan", "finite number >= 0"]),
    ({"aux_mu": 0.9, "aux_mu_end": float("inf")}, ["aux_mu_end=inf", "finite number >= 0"]),
    ({"aux_mu": "0.9"}, ["aux_mu='0.9'", "not a number"]),
    ({"aux_mu": 0.9, "digit_loss": {"type": "del", "weight": -1}}, ["digit_loss=", "weight", "greater than or equal"]),
    ({"aux_mu": 0.9, "digit_loss": {"type": "del", "wieght": 0.3}}, ["did you mean weight"]),
], ids=["negative", "nan", "end_inf", "string", "negative_weight", "typo"])
def test_a_bad_auxiliary_weight_or_digit_loss_is_refused_before_the_model_loads(tmp_path, extra, words):
    """The model is a path that does not exist: the refusal comes before TRL would try to load it."""
    from trl import GRPOConfig

    from delft.integrations.grpo import DigitGRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "out"), report_to=[], bf16=False, use_cpu=True)
    with pytest.raises((ValueError, TypeError)) as err:
        DigitGRPOTrainer(model=str(tmp_path / "no-model"), args=args, reward_funcs=[len], **extra)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert not (tmp_path / "out").exists()
