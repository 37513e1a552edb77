"""``delft recipe check RECIPE --show-examples N``: what the model will see, before any training. The first N
training examples exactly as the trainer gets them (delft.training.setup: the same tokenizer, template, masking
and truncation), each token marked as masked (no loss) or trained, and the digits the digit term scores with
their place (1 = units, 2 = tens, -1 = tenths, ...) and DEL place weight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rich.console import Console

from delft.recipe.schema import Recipe
from delft.training.setup import setup


@dataclass
class TokenView:
    text: str  # the token as the tokenizer decodes it alone
    trained: bool  # its label takes part in the loss
    places: tuple  # its digit characters' places, () for anything but a trained number token
    weights: tuple  # their DEL place weights (loss.place_weights), () likewise


def preview_examples(recipe: Recipe, n: int) -> list[list[TokenView]]:
    """The first ``n`` training examples as the trainer sees them (no weights are loaded)."""
    s = setup(recipe)
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

    examples = preview_examples(recipe, n)
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
    return examples
