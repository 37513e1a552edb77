"""``loss.type: dft`` (Dynamic Fine-Tuning, arXiv 2508.05629): each label's CE weighted by the detached probability
of the label, equal to TRL's ``SFTConfig(loss_type="dft")`` on the same batch, from hidden states in chunks."""

from __future__ import annotations

import pytest
import torch
from tiny import build_model, build_tokenizer

from delft.errors import UserError
from delft.losses import DigitLoss, Loss
from delft.recipe.schema import LossConfig

IGNORE = -100


def _batch(tok):
    """Two prompt + completion rows of different lengths, the prompts and the padding masked."""
    rows = [("What is 12 + 30?\n", "42"), ("What is 7 * 8?\n", "56 exactly")]
    ids, labels = [], []
    for prompt, completion in rows:
        p, c = tok(prompt)["input_ids"], tok(completion)["input_ids"] + [tok.eos_token_id]
        ids.append(p + c)
        labels.append([IGNORE] * len(p) + c)
    width = max(map(len, ids))
    pad = [width - len(x) for x in ids]
    return {"input_ids": torch.tensor([x + [tok.pad_token_id] * n for x, n in zip(ids, pad)]),
            "attention_mask": torch.tensor([[1] * len(x) + [0] * n for x, n in zip(ids, pad)]),
            "labels": torch.tensor([x + [IGNORE] * n for x, n in zip(labels, pad)])}


def _delft_dft(model, batch, chunk_size: int = 4, split: int = 1):
    """delft's dft loss from the last hidden states (after the final norm), the batch in ``split`` micro-batches
    normalised over the whole batch: what the trainer backpropagates, summed."""
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    h, labels = hidden[:, :-1], batch["labels"][:, 1:]  # hidden[:, t] predicts token t + 1
    loss = Loss("dft", chunk_size=chunk_size)
    counts = loss.count(labels)
    rows = torch.arange(h.shape[0]).chunk(split)
    return sum(loss.combine(loss.sums(h[r], model.lm_head, labels[r]), counts) for r in rows)


def test_dft_equals_trls_sft_loss_type_dft_on_the_same_batch(tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tok = build_tokenizer()
    model = build_model(tok, hidden=32, layers=2)
    args = SFTConfig(str(tmp_path / "trl"), loss_type="dft", report_to=[], use_cpu=True, bf16=False, max_length=None,
                     save_strategy="no", disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, processing_class=tok,
                         train_dataset=Dataset.from_list([{"prompt": "What is 1 + 1?\n", "completion": "2"}]))
    batch = _batch(tok)
    model.train()
    theirs = trainer.compute_loss(model, {k: v.clone() for k, v in batch.items()})
    ours = _delft_dft(model, batch)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-6, abs=1e-7)
    # not CE under another name: CE on the same batch is larger (each label's CE is multiplied by p_y < 1)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1))
    assert float(ce.detach()) > 1.5 * float(ours.detach())


def test_dft_is_the_same_whatever_the_micro_batch_split_and_chunk_and_its_gradient_too():
    tok = build_tokenizer()
    model = build_model(tok, hidden=32, layers=2)
    batch = _batch(tok)
    grads = []
    for split, chunk in ((1, 1024), (2, 3)):
        model.zero_grad()
        value = _delft_dft(model, batch, chunk, split)
        value.backward()
        grads.append((float(value.detach()), model.lm_head.weight.grad.clone()))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    assert torch.allclose(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-8)
    # the full-logits module (DigitLoss) agrees with the hidden-state path
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    full = DigitLoss(None, type="dft")(logits, batch["labels"][:, 1:])
    assert float(full.detach()) == pytest.approx(grads[0][0], rel=1e-6)


def test_dft_takes_no_weight_and_no_fused_path():
    with pytest.raises(ValueError, match="weight does not apply to type 'dft'"):
        LossConfig(type="dft", weight=0.3)
    assert LossConfig(type="dft").weight == 0.0

    class Recipe:  # only the keys Loss.from_recipe reads before it refuses
        class loss:
            type = "dft"

        class train:
            fused_loss = "on"

        class data:
            numbers = None

    with pytest.raises(UserError, match="Liger's fused cross-entropy"):
        Loss.from_recipe(Recipe, None, "cpu")
