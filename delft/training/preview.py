"""``delft recipe check RECIPE --show-examples N``: what the model will see, before any training. The first N
training examples exactly as the trainer gets them (delft.training.setup: the same tokenizer, template, masking
and truncation), each token marked as masked (no loss) or trained, and the digits the digit term scores with
their place (1 = units, 2 = tens, -1 = tenths, ...) and DEL place weight."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from rich.console import Console

from delft.data.prompts import use_chat_template
from delft.data.templates import render_chat
from delft.errors import UserError
from delft.recipe.schema import Recipe
from delft.training.setup import setup

_PROBE_SYSTEM, _PROBE_USER = "\x01system\x01", "\x01user\x01"  # text no template writes itself


@dataclass
class TokenView:
    text: str  # the token as the tokenizer decodes it alone
    trained: bool  # its label takes part in the loss
    places: tuple  # its digit characters' places, () for anything but a trained number token
    weights: tuple  # their DEL place weights (loss.place_weights), () likewise


def default_system_prompt(tokenizer) -> str:
    """The system prompt a chat template writes when the messages hold none ('' if it writes none): the text
    between what a conversation with a system message and one without share at their start and end."""
    user = [{"role": "user", "content": _PROBE_USER}]
    try:
        alone = render_chat(tokenizer, user)
        with_system = render_chat(tokenizer, [{"role": "system", "content": _PROBE_SYSTEM}] + user)
    except UserError:  # a template that refuses system messages writes none of its own either
        return ""
    start = len(os.path.commonprefix([alone, with_system]))
    end = len(os.path.commonprefix([alone[start:][::-1], with_system[start:][::-1]]))
    return alone[start:len(alone) - end].strip()


def template_note(recipe: Recipe, tokenizer) -> str:
    """What the chat template does to rows that are not chat messages ('' where no template is used): the
    model trains on the template's markup around them (and its default system prompt), not on the text as
    written, which is what data.template plain gives."""
    cfg = recipe.data
    if cfg.format == "chat" or not use_chat_template(tokenizer, cfg):
        return ""
    system = f"data.system_prompt {cfg.system_prompt!r} as the system message"
    if not cfg.system_prompt:
        default = default_system_prompt(tokenizer)
        system = (f"the template's default system prompt {default!r}" if default else
                  "no system message (this template writes none by default)")
    return (f"data.template {cfg.template}: each {cfg.format} prompt is a user message in the tokenizer's chat "
            f"template, with {system}; the model trains on that text, not the rows joined as written. Set "
            "data.template: plain to train on the text as written, or data.system_prompt to choose the system "
            "message.")


def preview_examples(recipe: Recipe, n: int) -> list[list[TokenView]]:
    """The first ``n`` training examples as the trainer sees them (no weights are loaded)."""
    return _preview(setup(recipe), n)


def _preview(s, n: int) -> list[list[TokenView]]:
    vocab = s.loss.numbers
    out = []
    for item in s.train[:n]:
        labelled = [t if y != -100 else -100 for t, y in zip(item.input_ids, item.labels)]
        places = vocab.places(labelled) if vocab is not None else [()] * len(labelled)
        digits = [tuple(q for q in p if q is not None) for p in places]  # the point has no place
        out.append([TokenView(s.tokenizer.decode([t]), y != -100, p, tuple(s.loss.weigh(q) for q in p))
                    for t, y, p in zip(item.input_ids, item.labels, digits)])
    return out


def _place_text(view: TokenView) -> str:
    return ", ".join(f"{p} (w {w:g})" for p, w in zip(view.places, view.weights))


def show_examples(recipe: Recipe, n: int, console: Console, digit_term: Optional[str] = None) -> list:
    """Print each example as its text (masked part dim, trained part bold, scored digits underlined) and a table
    of its trained tokens; returns what ``preview_examples`` gave."""
    from rich.markup import escape
    from rich.table import Table

    s = setup(recipe)
    examples = _preview(s, n)
    term = digit_term or recipe.loss.type
    for i, tokens in enumerate(examples):
        text = "".join(f"[underline bold]{escape(v.text)}[/]" if v.places else
                       (f"[bold]{escape(v.text)}[/]" if v.trained else f"[dim]{escape(v.text)}[/]") for v in tokens)
        console.print(f"[bold]example {i}[/] ({len(tokens)} tokens, {sum(v.trained for v in tokens)} trained, "
                      f"{sum(len(v.places) for v in tokens)} scored digits): {text}", highlight=False)
        table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
        for col in ("position", "token", "digit places scored (weight)"):
            table.add_column(col)
        for pos, v in enumerate(tokens):
            if v.trained:
                table.add_row(str(pos), repr(v.text), _place_text(v) or "-")
        console.print(table)
    console.print(f"[dim]dim: masked (no loss); bold: trained (CE); underlined: digits the {term} term scores.[/]",
                  highlight=False)
    note = template_note(recipe, s.tokenizer)
    if note:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    return examples
