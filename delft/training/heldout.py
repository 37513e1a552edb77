"""Numeric accuracy while training (``train.accuracy_steps``): greedy exact match on a fixed held-out slice.

The slice is the first ``train.accuracy_examples`` problems of the recipe's eval set (``eval.data``, or the
synthetic source with the eval seed offset; a generated set drawn without the training problems), answered and
scored exactly as ``delft eval RECIPE --limit N`` does (delft.evaluation.generation.greedy,
delft.numbers.answers), so the last row in metrics.jsonl equals that command's exact match for the final adapter.
The validation split is not used: its examples are tokenized for the loss, and the eval set is the one a user
reads results on.

A slice that is the training data is refused (``check_heldout_slice``, before any weights load, by ``delft train``
and ``delft recipe check`` alike; a hub eval set once it is loaded): with a file or hub source and no eval.data
the eval set is the training source itself, and a slice mostly of training problems (by normalised prompt, over
half, the line ``delft eval`` draws) would report what the model remembers as held-out accuracy. Taking the slice
from the rows training leaves out (the validation split) would keep the number honest but break its one promise,
that it is what ``delft eval`` says on the eval set; so the user names a held-out set instead. A few training
problems in it are said, not refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from rich.console import Console

from delft.data.pipeline import load_examples
from delft.data.prompts import read_completion, render_prompt, use_chat_template
from delft.data.sources import is_data_file, normalised_prompt
from delft.errors import UserError
from delft.evaluation.contamination import SEEN_LIMIT, generated_exclusion, training_prompts
from delft.evaluation.generation import greedy, stop_strings
from delft.evaluation.metrics import METRICS, summarize
from delft.evaluation.problems import disjoint_from_training, load_problems
from delft.models.loading import check_nf4_exact
from delft.numbers.answers import cut_at_stop, extract_answer, score
from delft.outputs import pct
from delft.recipe.schema import GENERATED


def heldout_data(recipe, n: int):
    """The eval set's DataConfig limited to its first ``n`` problems (as ``delft eval --limit n`` resolves it),
    with the numbers written as the run trains them (data.numbers, as eval reads them from its recipe.yaml)."""
    data = recipe.eval_data()
    limit = min(n, data.limit) if data.limit else n
    update = {"limit": limit, "val_size": 0, "numbers": recipe.data.numbers}
    return disjoint_from_training(data.model_copy(update=update), recipe.data)


HELD_OUT_FIX = ("Set eval.data to problems kept out of training (split the file: e.g. its last 200 rows into "
                "heldout.jsonl for eval.data, the rest into data.source), or set train.accuracy_steps: 0 and follow "
                "the validation loss (data.val_size).")


def check_heldout_slice(recipe) -> None:
    """Refuse, before any weights load, a held-out slice that is the training data: no eval.data with a file or hub
    source (the eval set is then the training source), or a local eval.data file mostly of the local training
    file's problems. Other pairs (a hub set on either side) are counted once loaded (``HeldOut.from_recipe``)."""
    t = recipe.train
    if not t.accuracy_steps or t.stage != "sft":
        return
    data = heldout_data(recipe, t.accuracy_examples)
    if data.format in GENERATED:
        return  # drawn without the training problems
    if recipe.eval.data is None:
        raise UserError(f"train.accuracy_steps measures exact match on the first {data.limit} problems of the eval "
                        f"set, and with eval.data unset the eval set is the training data itself ({data.source}): "
                        "every one is a row of the training data, so the held-out accuracy would say what the model "
                        "remembers, not what it can solve", "eval.data", HELD_OUT_FIX)
    if is_data_file(recipe.data.source) and is_data_file(data.source):
        seen_in_slice(recipe, data, load_examples(data, "eval.data"))


def seen_in_slice(recipe, data, examples: Sequence) -> int:
    """How many of the slice's ``examples`` (of ``data``, the held-out DataConfig) are training problems (by
    normalised prompt, validation split included: delft.evaluation.contamination.training_prompts); more than
    SEEN_LIMIT of them is refused."""
    prompts = training_prompts(recipe.data)
    k, n = sum(normalised_prompt(e.prompt) in prompts for e in examples), len(examples)
    if k <= SEEN_LIMIT * n:
        return k
    same = is_data_file(data.source) and is_data_file(recipe.data.source) and \
        Path(data.source).expanduser().resolve() == Path(recipe.data.source).expanduser().resolve()
    what = "the same file as data.source" if same else data.source
    raise UserError(f"the held-out slice of train.accuracy_steps, the first {n} problems of eval.data ({what}), is "
                    f"mostly training data: {k} of them ({pct(k / n)}) are problems of data.source (same prompt, "
                    "whitespace aside), so the held-out accuracy would say what the model remembers, not what it "
                    "can solve", "eval.data", HELD_OUT_FIX)


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
        if data.format not in GENERATED:  # a generated set is drawn without them
            seen = seen_in_slice(recipe, data, [p.example for p in problems])
            if seen:
                console.print(f"[yellow]note:[/] {seen} of the {len(problems)} held-out problems (eval.data) are "
                              "training problems too (same prompt): the held-out accuracy counts them",
                              highlight=False)
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
