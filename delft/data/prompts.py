"""An example as the model sees it: the prompt and completion text, its numbers written as ``data.numbers`` says
(delft.numbers.formats), through the tokenizer's chat template when the recipe asks for one (rendered within
bounds, delft.data.templates); and a model's answer read back into natural numbers before it is scored."""

from __future__ import annotations

from dataclasses import replace

from delft.data.sources import Example
from delft.data.templates import render_chat
from delft.errors import UserError
from delft.numbers.formats import NumberForm


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
    """A completion with its numbers in the data section's form (delft.numbers.formats.NumberForm)."""
    return NumberForm.of(cfg.numbers).write_completion(text)


def read_completion(text: str, cfg) -> str:
    """A model's answer, written in the data section's form, as natural text for the scorer (cut at the stop
    strings first). An answer in Arabic-Indic or full-width digits is read as its ASCII digits, so it is read back
    (unreversed, unwrapped) like any other rather than scored as written."""
    return NumberForm.of(cfg.numbers).read_completion(text)


def written_question(text: str, cfg) -> str:
    """A question's text with its numbers written as the model saw its prompts (only with scope everything)."""
    return NumberForm.of(cfg.numbers).write_question(text)


def _written_prompt(example: Example, cfg) -> Example:
    """The example with its prompt's numbers written as the model saw them: only with scope everything."""
    if not NumberForm.of(cfg.numbers).writes_prompts:
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
