"""Numeric accuracy while training (``train.accuracy_steps``): greedy exact match on a fixed held-out slice.

The slice is the first ``train.accuracy_examples`` problems of the recipe's eval set (``eval.data``, or the
synthetic source with the eval seed offset; a generated set drawn without the training problems), answered and
scored exactly as ``delft eval RECIPE --limit N`` does (delft.evaluation.generation.greedy,
delft.numbers.answers), so the last row in metrics.jsonl equals that command's exact match for the final adapter.
The validation split is not used: its examples are tokenized for the loss, and the eval set is the one a user
reads results on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rich.console import Console

from delft.data.prompts import read_completion, render_prompt, use_chat_template
from delft.evaluation.contamination import generated_exclusion
from delft.evaluation.generation import greedy, stop_strings
from delft.evaluation.metrics import METRICS, summarize
from delft.evaluation.problems import disjoint_from_training, load_problems
from delft.models.loading import check_nf4_exact
from delft.numbers.answers import cut_at_stop, extract_answer, score


def heldout_data(recipe, n: int):
    """The eval set's DataConfig limited to its first ``n`` problems (as ``delft eval --limit n`` resolves it),
    with the numbers written as the run trains them (data.numbers, as eval reads them from its recipe.yaml)."""
    data = recipe.eval_data()
    limit = min(n, data.limit) if data.limit else n
    update = {"limit": limit, "val_size": 0, "numbers": recipe.data.numbers}
    return disjoint_from_training(data.model_copy(update=update), recipe.data)


@dataclass
class HeldOut:
    """The rendered prompts and gold answers of the slice, and how to answer them."""

    problems: Sequence  # delft.evaluation.problems.Problem
    prompts: list[str]
    chat: bool
    stops: list[str]
    tokenizer: object
    max_new_tokens: int
    batch_size: int
    data: object = None  # its DataConfig: how the answers' numbers are read back (None: as written)

    @classmethod
    def from_recipe(cls, recipe, tokenizer, console: Console) -> "HeldOut":
        data = heldout_data(recipe, recipe.train.accuracy_examples)
        problems, _ = load_problems(data, console, generated_exclusion(data, [recipe.data], []))
        chat = use_chat_template(tokenizer, data)
        prompts = [render_prompt(p.example, tokenizer, data) for p in problems]
        return cls(problems, prompts, chat, stop_strings(tokenizer, chat), tokenizer, recipe.eval.max_new_tokens,
                   recipe.eval.batch_size, data)

    def measure(self, model) -> dict:
        """Exact match, tolerance match and digit accuracy of greedy answers (the metrics with a
        Metric.heldout name, under it); ``model`` is left as it was.

        Generation needs eval mode (no LoRA dropout; HF turns the KV cache off while gradient checkpointing
        trains) and ``use_cache`` on, which training turns off.
        """
        was_training, use_cache = model.training, getattr(model.config, "use_cache", None)
        model.eval()
        model.config.use_cache = True
        try:
            generations = greedy(model, self.tokenizer, self.prompts, self.max_new_tokens, self.chat,
                                 self.batch_size)
        finally:
            model.config.use_cache = use_cache
            if was_training:
                model.train()
        check_nf4_exact(model)  # generation is when bitsandbytes would repack an nf4 layer
        texts = [cut_at_stop(g.text, self.stops) for g in generations]
        if self.data is not None:
            texts = [read_completion(t, self.data) for t in texts]
        scored = [score(extract_answer(t, self.stops), p.gold) for t, p in zip(texts, self.problems)]
        m = summarize(scored, resamples=0)
        return {**{x.heldout: m[x.key] for x in METRICS if x.heldout}, "accuracy_n": m["n"]}
