"""An example as the model sees it: the prompt and completion text, its numbers written as ``data.numbers`` says
(delft.numbers.formats), through the tokenizer's chat template when the recipe asks for one (rendered within
bounds, delft.data.templates); and a model's answer read back into natural numbers before it is scored."""

from __future__ import annotations

from dataclasses import replace

from delft.data.sources import Example
from delft.data.templates import render_chat
from delft.errors import UserError
from delft.numbers.digits import ascii_digits
from delft.numbers.formats import read_last_number, read_numbers, write_last_number, write_numbers


def use_chat_template(tokenizer, cfg) -> bool:
    has = bool(getattr(tokenizer, "chat_template", None))
    if cfg.template == "chat" and not has:
        raise UserError("data.template is 'chat' but the tokenizer has no chat template", "data.template",
                        "Use template: plain (or auto).")
    return cfg.format == "chat" or (cfg.template != "plain" and has)


def _messages(example: Example, cfg) -> list[dict]:
    msgs = list(example.prompt) if isinstance(example.prompt, list) else [{"role": "user", "content": example.prompt}]
    if cfg.system_prompt and not any(m["role"] == "system" for m in msgs):
        msgs.insert(0, {"role": "system", "content": cfg.system_prompt})
    return msgs


def written_completion(text: str, cfg) -> str:
    """A completion with its numbers in the data section's form (all of them, or with scope answer its last).
    Digits of other scripts are written as ASCII digits first: the forms reverse and count ASCII digits only, and
    the scorer reads a model's answer the same way (read_completion)."""
    n = cfg.numbers
    if not n.active():
        return text
    write = write_last_number if n.scope == "answer" else write_numbers
    return write(ascii_digits(text), n.order, n.count_prefix)


def read_completion(text: str, cfg) -> str:
    """A model's answer, written in the data section's form, as natural text for the scorer. Give it the text cut
    at the stop strings: with scope answer only the last number is read back, which must be the answer's. An
    answer in Arabic-Indic or full-width digits is read as its ASCII digits, so it is read back (unreversed,
    unwrapped) like any other rather than scored as written."""
    n = cfg.numbers
    if not n.active():
        return text
    read = read_last_number if n.scope == "answer" else read_numbers
    return read(ascii_digits(text), n.order, n.count_prefix)


def _writes_prompts(cfg) -> bool:
    """Whether data.numbers rewrites the prompts' numbers too (scope everything, a form other than natural)."""
    return cfg.numbers.active() and cfg.numbers.scope == "everything"


def written_question(text: str, cfg) -> str:
    """A question's text with its numbers written as the model saw its prompts (only with scope everything)."""
    n = cfg.numbers
    return write_numbers(ascii_digits(text), n.order, n.count_prefix) if _writes_prompts(cfg) else text


def _written_prompt(example: Example, cfg) -> Example:
    """The example with its prompt's numbers written as the model saw them: only with scope everything."""
    if not _writes_prompts(cfg):
        return example
    if isinstance(example.prompt, list):
        prompt = [{**m, "content": written_question(m["content"], cfg)} for m in example.prompt]
    else:
        prompt = written_question(example.prompt, cfg)
    return replace(example, prompt=prompt)


# A plain prompt that already ends in one of these has its break: no separator follows it (alpaca's template ends
# "### Response:\n", some reasoning-gym questions end in a newline; a second one would be a blank line).
PROMPT_BREAKS = ("\n", " ")


def render_prompt(example: Example, tokenizer, cfg) -> str:
    """The exact text the answer continues: the chat template's rendering when configured, else the plain prompt
    (chat messages one per line) followed by ``cfg.prompt_separator()`` unless it already ends in PROMPT_BREAKS.
    With data.numbers scope everything, the prompt's numbers are written in its form."""
    return _render_written_prompt(_written_prompt(example, cfg), tokenizer, cfg)


def _render_written_prompt(example: Example, tokenizer, cfg) -> str:
    if use_chat_template(tokenizer, cfg):  # someone else's program: rendered within bounds (delft.data.templates)
        return render_chat(tokenizer, _messages(example, cfg), add_generation_prompt=True)
    prompt = example.prompt
    if isinstance(prompt, list):
        prompt = "\n".join(m["content"] for m in prompt)
    return prompt if prompt.endswith(PROMPT_BREAKS) else prompt + cfg.prompt_separator()


def render_pair(example: Example, tokenizer, cfg) -> tuple[str, str]:
    """(prompt text, completion text including the end-of-turn / EOS the model must learn), numbers written as
    data.numbers says."""
    example = replace(_written_prompt(example, cfg), completion=written_completion(example.completion, cfg))
    prompt = _render_written_prompt(example, tokenizer, cfg)
    if use_chat_template(tokenizer, cfg):
        full = render_chat(tokenizer, _messages(example, cfg) + [{"role": "assistant", "content": example.completion}])
        if full.startswith(prompt):
            return prompt, full[len(prompt):]
    return prompt, example.completion + (tokenizer.eos_token or "")
