"""delft.integrations.axolotl: DigitLossPlugin through axolotl's own PluginManager and config validation, and its
post-create hook on a real DigitTrainer (axolotl's trainer itself needs axolotl's full stack, absent here)."""

from __future__ import annotations

import pytest

from helpers import extra_missing  # noqa: E402

if extra_missing("axolotl"):  # the module imports axolotl at its top: skipped whole, with the install command
    pytest.skip(extra_missing("axolotl"), allow_module_level=True)

import torch
from axolotl.integrations.base import BasePlugin, PluginManager
from axolotl.utils.dict import DictDefault
from tiny import build_model, build_tokenizer

NAME = "delft.integrations.axolotl.DigitLossPlugin"
TEXTS = ["Q: what is two plus one?\nA: 3", "Q: 123456.789 + 0.000012?\nA: 123456.789012"]
BASE = {"base_model": "tiny", "datasets": [{"path": "d", "type": "alpaca"}], "micro_batch_size": 1,
        "gradient_accumulation_steps": 1, "learning_rate": 1e-4, "num_epochs": 1, "output_dir": "/tmp/axo-out"}


@pytest.fixture
def manager():
    """axolotl's PluginManager (a process-wide singleton) holding only this plugin during the test."""
    pm = PluginManager.get_instance()
    before = dict(pm.plugins)
    pm.plugins.clear()
    pm.register(NAME)
    yield pm
    pm.plugins.clear()
    pm.plugins.update(before)


def validated(digit_loss) -> DictDefault:
    """The config as axolotl's own validation returns it (the plugin's args merged into the schema)."""
    from axolotl.utils.config import validate_config

    return validate_config(DictDefault({**BASE, "plugins": [NAME], "digit_loss": digit_loss}))


def collate(rows):
    width = max(len(r["input_ids"]) for r in rows)
    pad = [width - len(r["input_ids"]) for r in rows]
    return {"input_ids": torch.tensor([r["input_ids"] + [0] * p for r, p in zip(rows, pad)]),
            "labels": torch.tensor([r["labels"] + [-100] * p for r, p in zip(rows, pad)]),
            "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * p for r, p in zip(rows, pad)])}


def encode(tok):
    rows = []
    for t in TEXTS:
        prompt, answer = t.split("A: ")
        p, a = tok.encode(prompt + "A: ", add_special_tokens=False), tok.encode(answer, add_special_tokens=False)
        rows.append({"input_ids": p + a, "labels": [-100] * len(p) + a})
    return rows


def make_trainer(cls):
    from datasets import Dataset
    from transformers import TrainingArguments

    tok = build_tokenizer()
    args = TrainingArguments(output_dir="/tmp/delft-axolotl-test", per_device_train_batch_size=2, max_steps=1,
                             logging_steps=1, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    return cls(model=build_model(tok, hidden=32, layers=2), args=args, train_dataset=Dataset.from_list(encode(tok)),
               data_collator=collate, processing_class=tok)


def test_the_plugin_registers_by_its_dotted_name(manager):
    plugin = manager.plugins[NAME]
    assert isinstance(plugin, BasePlugin) and type(plugin).__name__ == "DigitLossPlugin"
    assert "delft.integrations.axolotl.DigitLossArgs" in manager.get_input_args()


def test_axolotls_config_validation_takes_the_block_and_refuses_typos(manager):
    from axolotl.integrations.config import merge_input_args

    from delft.integrations.axolotl import loss_options

    assert "digit_loss" in merge_input_args()[1].model_fields
    cfg = validated({"type": "del_prob", "weight": 0.3})
    assert (cfg.digit_loss.type, cfg.digit_loss.weight) == ("del_prob", 0.3)
    assert "tau" in cfg.digit_loss and "tau" not in loss_options(cfg.digit_loss)  # dist2's own option dropped
    assert validated({}).digit_loss.type == "del_prob" and validated(None).digit_loss is None
    with pytest.raises(ValueError, match=r"digit_loss\.wieght"):
        validated({"type": "del_prob", "wieght": 0.3})
    with pytest.raises(ValueError, match=r"digit_loss\.type(.|\n)*del_prop"):
        validated({"type": "del_prop"})
    with pytest.raises(ValueError, match="tau only applies to type 'dist2'"):
        validated({"type": "del", "tau": 2.0})


def test_post_trainer_create_hands_the_block_to_the_loss_and_a_step_uses_it(manager):
    from delft.integrations.hf import DigitTrainer

    trainer = make_trainer(DigitTrainer)
    assert (trainer.digit_loss.loss.type, trainer.digit_loss.loss.weight) == ("del_prob", 0.3)  # the default
    manager.post_trainer_create(validated({"type": "dist2", "weight": 0.7, "tau": 0.5}), trainer)
    loss = trainer.digit_loss.loss
    assert (loss.type, loss.weight, loss.params) == ("dist2", 0.7, {"tau": 0.5})
    trainer.train()
    log = next(h for h in trainer.state.log_history if "loss" in h)
    assert log["digit_term"] > 0 and log["digit_weight"] == 0.7
    assert log["loss"] == pytest.approx(log["ce"] + 0.7 * log["digit_term"], rel=1e-5)


def test_get_trainer_cls_is_axolotls_trainer_with_the_mixin_only_with_a_block(manager):
    from delft.integrations.hf import DigitLossMixin

    plugin = manager.plugins[NAME]
    assert plugin.get_trainer_cls(DictDefault({})) is None and manager.get_trainer_cls(validated(None)) is None
    with pytest.raises(ValueError, match="rl: dpo"):
        plugin.get_trainer_cls(DictDefault({"digit_loss": {}, "rl": "dpo"}))
    try:
        from axolotl.core.trainers.base import AxolotlTrainer
    except ImportError as exc:  # here: axolotl installed without its dependencies (numba, ...)
        with pytest.raises(ImportError) as info:
            manager.get_trainer_cls(validated({}))
        assert "axolotl's trainer" in str(info.value) and "AxolotlTrainer" in str(info.value)
        assert exc.name and f"'{exc.name}'" in str(info.value) and info.value.name == exc.name
    else:  # axolotl's full stack
        cls = manager.get_trainer_cls(validated({}))
        assert issubclass(cls, DigitLossMixin) and issubclass(cls, AxolotlTrainer)
        assert cls.__mro__.index(DigitLossMixin) < cls.__mro__.index(AxolotlTrainer)


def test_post_trainer_create_refuses_a_trainer_without_the_mixin(manager):
    from transformers import Trainer

    trainer = make_trainer(Trainer)
    manager.post_trainer_create(DictDefault({}), trainer)  # no block: nothing to do
    with pytest.raises(TypeError, match="trainer is Trainer, not a DigitLossMixin"):
        manager.post_trainer_create(DictDefault({"digit_loss": {"type": "del_prob"}}), trainer)
