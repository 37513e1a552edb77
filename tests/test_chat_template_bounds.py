"""A chat template from a model or run folder is someone else's program (issue 51, item 5): delft renders it within
a step budget, a time limit and a size limit (delft.data.templates), and refuses one that passes them, or that the
sandbox refuses, with one paragraph naming the file. Real tiny model folders, the real CLI, real Jinja."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from helpers import recipe_file, refused, run_cli
from tiny import CHAT_TEMPLATE, build_tokenizer, save_tiny

from delft.data.templates import MAX_STEPS, render_chat
from delft.errors import UserError

FAST = ["--set", "eval.max_new_tokens=2", "--set", "eval.batch_size=2", "--set", "eval.bootstrap=10"]
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"
UNBOUNDED = 60  # seconds: far above a refusal (well under one), far below the loop's 10^10 steps (hours)

# A template in the style of the hub's chat models (Qwen, Llama 3): namespaces, loop variables, slicing, tojson,
# macros, {% generation %}, a default system prompt and a raise_exception branch the conversations never take.
RICH = """{%- macro render(m) -%}<|{{ m['role'] }}|>{{ m['content'] | trim }}{%- endmacro -%}
{%- set ns = namespace(last_user=-1, system=false) -%}
{%- for m in messages[::-1] %}{% if m.role == 'user' and ns.last_user < 0 %}{% set ns.last_user = messages|length - loop.index0 - 1 %}{% endif %}{% endfor -%}
{%- if messages[0]['role'] == 'system' %}{{ render(messages[0]) }}{% set ns.system = true %}{% else %}<|system|>You are helpful. {{ {'n': messages|length, 'k': [1, 2]}|tojson }}{% endif %}
{%- for m in messages %}{% if loop.first and ns.system %}{% continue %}{% endif %}
{%- if m['role'] not in ['user', 'assistant', 'system'] %}{{ raise_exception('unknown role ' ~ m['role']) }}{% endif %}
{%- if m.role == 'assistant' %}<|assistant|>{% generation %}{{ m.content.split('</think>')[-1] | trim }}{% endgeneration %}</s>
{%- else %}{{ render(m) }}{{ '\\n' if not loop.last else '' }}{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|assistant|>{{ bos_token if ns.last_user == messages|length - 1 else '' }}{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 7?"}],
    [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "What is 3 * 4?"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>hm</think> 4"},
     {"role": "user", "content": "and 3+3?"}],
]


def model_with_template(tmp_path: Path, template: str, in_config: bool = False) -> Path:
    """A tiny model folder whose chat template is ``template``: in chat_template.jinja (as transformers saves it),
    or in tokenizer_config.json's chat_template (as older folders hold it)."""
    model = save_tiny(tmp_path / "model")
    if in_config:
        (model / "chat_template.jinja").unlink()
        config = json.loads((model / "tokenizer_config.json").read_text())
        (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    else:
        (model / "chat_template.jinja").write_text(template)
    return model


def test_a_looping_template_is_stopped_with_a_paragraph_in_eval_and_train(tmp_path):
    model = model_with_template(tmp_path, LOOP)
    start = time.monotonic()
    refused(run_cli("eval", "--model", model, "--data", "synthetic", "--limit", "2", *FAST),
            f"{model / 'chat_template.jinja'}: the chat template cannot be used", f"more than {MAX_STEPS:,} steps",
            "data.template: plain")
    refused(run_cli("train", recipe_file(tmp_path, model)), str(model / "chat_template.jinja"), "loops or grows")
    assert time.monotonic() - start < UNBOUNDED
    assert not (tmp_path / "run").exists()
    plain = recipe_file(tmp_path, model, name="plain", data={"template": "plain"})  # the way around it, as said
    assert run_cli("recipe", "check", plain, "--show-examples", "1").exit_code == 0


def test_a_template_the_sandbox_refuses_is_one_paragraph(tmp_path):
    model = model_with_template(tmp_path, "{{ messages[0].content.__class__.__mro__ }}", in_config=True)
    refused(run_cli("inspect", "--model", model, "--target", "12", "What is 5 + 7?"),
            f"{model / 'tokenizer_config.json'}: the chat template cannot be used",
            "does what the template sandbox forbids", "access to attribute '__class__' of 'str' object is unsafe")


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, RICH])
def test_the_bounded_render_is_transformers_own_text(template):
    tok = build_tokenizer()
    tok.chat_template = template
    for messages in CONVERSATIONS:
        for generation in (False, True):
            want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
            assert render_chat(tok, messages, add_generation_prompt=generation) == want


@pytest.mark.parametrize("template, said", [
    ("{% set l = range(100000)|list %}{% for a in l %}{% for b in l %}{% endfor %}{% endfor %}", "steps"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}", "steps"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "a value"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set b %}{{ ns.s }}{{ ns.s }}{% endset %}"
     "{% set ns.s = b %}{% endfor %}", "a value"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "an output"),
    ("{{ 'x' * 10000000000 }}", "a repetition of 10,000,000,000"),
    ("{{ 2 ** 10000000000 }}", "bits"),
    ("{{ '{:>999999999}'.format(1) }}{{ '%999999999d' % 1 }}", "format width"),
    ("{{ ('a' * 1000000)|replace('', 'b' * 1000000) }}", "replace making text"),
    ("{{ range(100000)|join('b' * 1000000) }}", "join making text"),
    ("{{ ('\\n' * 1000000)|indent(1000000) }}", "indent making text"),
    ("{{ 'x'.center(10000000000) }}", "center with the number"),
])
def test_every_bound_stops_its_template_before_it_allocates(template, said):
    tok = build_tokenizer()
    tok.chat_template = template
    with pytest.raises(UserError, match=f"stopped after .*{said}"):
        render_chat(tok, CONVERSATIONS[0])


def test_the_bounds_hold_off_the_main_thread_and_leave_ordinary_templates_alone():
    """No signal or timer: a render in a worker thread is stopped the same way (signal.alarm could not do that)."""
    tok = build_tokenizer()
    tok.chat_template = LOOP
    caught = []
    worker = threading.Thread(target=lambda: caught.append(pytest.raises(UserError, render_chat, tok,
                                                                         CONVERSATIONS[0])))
    worker.start()
    worker.join(UNBOUNDED)
    assert not worker.is_alive() and "steps" in str(caught[0].value)
    tok.chat_template = RICH  # a long conversation with a long message stays well within the bounds
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 50} for i in range(199)]
    long[0]["content"] = "x" * 20_000_000  # past the fixed size limit: the limit grows with the messages
    assert render_chat(tok, long, add_generation_prompt=True) == tok.apply_chat_template(
        long, tokenize=False, add_generation_prompt=True)
