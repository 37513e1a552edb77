"""An example as the model sees it: the prompt and completion text, through the tokenizer's chat template when
the recipe asks for one."""

from __future__ import annotations

from delft.data.sources import Example
from delft.errors import UserError


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


# A plain prompt that already ends in one of these has its break: no separator follows it (alpaca's template ends
# "### Response:\n", some reasoning-gym questions end in a newline; a second one would be a blank line).
PROMPT_BREAKS = ("\n", " ")


def render_prompt(example: Example, tokenizer, cfg) -> str:
    """The exact text the answer continues: the chat template's rendering when configured, else the plain prompt
    (chat messages one per line) followed by ``cfg.prompt_separator()`` unless it already ends in PROMPT_BREAKS."""
    if use_chat_template(tokenizer, cfg):
        return tokenizer.apply_chat_template(_messages(example, cfg), tokenize=False, add_generation_prompt=True)
    prompt = example.prompt
    if isinstance(prompt, list):
        prompt = "\n".join(m["content"] for m in prompt)
    return prompt if prompt.endswith(PROMPT_BREAKS) else prompt + cfg.prompt_separator()


def render_pair(example: Example, tokenizer, cfg) -> tuple[str, str]:
    """(prompt text, completion text including the end-of-turn / EOS the model must learn)."""
    prompt = render_prompt(example, tokenizer, cfg)
    if use_chat_template(tokenizer, cfg):
        full = tokenizer.apply_chat_template(
            _messages(example, cfg) + [{"role": "assistant", "content": example.completion}], tokenize=False)
        if full.startswith(prompt):
            return prompt, full[len(prompt):]
    return prompt, example.completion + (tokenizer.eos_token or "")
