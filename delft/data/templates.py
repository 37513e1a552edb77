"""A chat template from someone else's folder rendered within bounds: a step budget, a time limit and a size limit.

A model or run folder's ``chat_template.jinja`` (or its tokenizer_config's ``chat_template``) is a program: Jinja
in transformers' sandbox cannot reach Python, but nothing bounds how long it runs or how much it writes, and a
template with a loop of 10^10 steps spins until killed. So delft renders it itself, in the same sandboxed
environment transformers builds for the template (its globals, filters and ``{% generation %}`` tag, so the text is
the one ``apply_chat_template`` gives), rewritten so that every loop iteration, call, filter, concatenation and
arithmetic operator counts one step. A render that passes ``MAX_STEPS`` steps or ``MAX_SECONDS`` seconds, or makes
a value or an output longer than its size limit, is stopped and refused naming the file; a size that only one
operation would reach (``'x' * 10**10``, ``10**10**10``, a format width of 10^9) is refused before that operation
allocates it. The checks run between the template's own steps, in whatever thread renders, with no signal or
timer: a signal-based limit works only on the main thread. What the sandbox itself refuses (``SecurityError``) and
a template that raises (``raise_exception``) are refused the same way, one paragraph each.
"""

from __future__ import annotations

import functools
import re
import time
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Optional

from delft.errors import UserError

MAX_STEPS = 100_000  # a chat template renders a conversation in hundreds of steps
MAX_SECONDS = 10.0  # and in milliseconds
MAX_CHARS = 2**24  # characters (or items) of any one value, plus 4 per character of the messages
MAX_BITS = 2**20  # bits of an integer (Python turns no more than 4,300 digits into text anyway)
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
STEPS_FILTER, SIZED_FILTER = "delft_steps", "delft_sized"  # the rewrite's own filters
_WIDTH = re.compile(r"%[-+ #0*]*\d{8,}|\{[^{}]*:[^{}]*\d{8,}[^{}]*\}")  # "%99999999d", "{:>99999999}"


class _OverBudget(BaseException):
    """A bound was passed. BaseException, so neither Jinja nor a filter's ``except Exception`` swallows it."""


class _Budget:
    """One render's steps, deadline and size limit."""

    def __init__(self, input_chars: int):
        self.steps = 0
        self.deadline = time.monotonic() + MAX_SECONDS
        self.max_size = MAX_CHARS + 4 * input_chars

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise _OverBudget(f"more than {MAX_STEPS:,} steps (loop iterations, calls and filters)")
        if time.monotonic() > self.deadline:
            raise _OverBudget(f"more than {MAX_SECONDS:g} seconds")

    def sized(self, value: Any) -> Any:
        if isinstance(value, (str, list, tuple, dict)) and len(value) > self.max_size:
            raise _OverBudget(f"a value of {len(value):,} characters or items (at most {self.max_size:,})")
        if isinstance(value, int) and value.bit_length() > MAX_BITS:
            raise _OverBudget(f"an integer of more than {MAX_BITS:,} bits")
        return value

    def refuse_larger(self, size: int, what: str) -> None:
        if size > self.max_size:
            raise _OverBudget(f"{what} of {size:,} characters or items (at most {self.max_size:,})")


_BUDGET: ContextVar[Optional[_Budget]] = ContextVar("delft_template_budget", default=None)


def _budget() -> _Budget:
    return _BUDGET.get() or _Budget(0)  # compile-time constant folding runs inside a render too; never unbounded


def _check_arguments(name: str, args: tuple, kwargs: dict) -> None:
    """Refuse, before it runs, an operation whose arguments would make a value past the size limit."""
    budget = _budget()
    values = [*args, *kwargs.values()]
    for n in values:
        if isinstance(n, int) and not isinstance(n, bool) and abs(n) > budget.max_size:
            raise _OverBudget(f"{name} with the number {n:,} (at most {budget.max_size:,})")
    text = next((v for v in values if isinstance(v, str)), "")
    widths = [n for n in values if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    if name in ("indent", "expandtabs", "tojson") and widths:  # the width is paid once per line (or tab, item)
        budget.refuse_larger(max(widths) * (len(text) + len(str(values[0])) + 1), f"{name} making text")
    if name == "replace" and len([v for v in values if isinstance(v, str)]) >= 3:
        s, old, new = [v for v in values if isinstance(v, str)][:3]
        budget.refuse_larger((s.count(old) if old else len(s) + 1) * len(new) + len(s), "replace making text")
    if name == "join" and len(values) >= 2:
        items, sep = (values[1], values[0]) if isinstance(values[0], str) else (values[0], values[1])
        if isinstance(sep, str) and hasattr(items, "__len__"):
            budget.refuse_larger(len(sep) * len(items), "join making text")
    if name in ("format", "format_map") and isinstance(text, str) and _WIDTH.search(text):
        raise _OverBudget("a format width of 8 digits or more")


def _counted_filter(name: str, func):
    passed = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0  # the context or environment, first

    @functools.wraps(func)  # keeps jinja_pass_arg, so Jinja still passes it
    def counted(*args, **kwargs):
        budget = _budget()
        budget.step()
        _check_arguments(name, args[passed:], kwargs)
        return budget.sized(func(*args, **kwargs))
    return counted


def _steps(iterable):
    """A loop's iterable, one step per item."""
    budget = _budget()
    budget.step()
    for item in iterable:
        budget.step()
        yield item


def _sized(value):
    _budget().step()
    return _budget().sized(value)


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse an arithmetic operation whose result would pass the size limit, before Python computes it."""
    budget = _budget()
    budget.step()
    whole = [isinstance(v, int) and not isinstance(v, bool) for v in (left, right)]
    if operator == "**" and all(whole) and right > 0 and abs(left) > 1 and left.bit_length() * right > MAX_BITS:
        raise _OverBudget(f"an integer of more than {MAX_BITS:,} bits ({left} ** {right})")
    if operator == "*" and any(whole):
        seq, n = (left, right) if whole[1] else (right, left)
        if isinstance(seq, (str, list, tuple)):
            budget.refuse_larger(len(seq) * n, "a repetition")
        elif all(whole) and left.bit_length() + right.bit_length() > MAX_BITS:
            raise _OverBudget(f"an integer of more than {MAX_BITS:,} bits")
    if operator == "%" and isinstance(left, str) and _WIDTH.search(left):
        raise _OverBudget("a format width of 8 digits or more")


def _bounded_environment(base):
    """An overlay of transformers' sandboxed environment for one template whose calls, filters and operators count
    and check (the base environment, transformers' cached one, is left as it is)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = base.overlay()
    env.filters = {name: _counted_filter(name, func) for name, func in base.filters.items()}
    env.filters[STEPS_FILTER], env.filters[SIZED_FILTER] = _steps, _sized
    env.intercepted_binops = frozenset({"*", "**", "%", "+"})

    def call_binop(context, operator, left, right):
        _check_binop(operator, left, right)
        return _budget().sized(ImmutableSandboxedEnvironment.call_binop(env, context, operator, left, right))

    def call(context, obj, *args, **kwargs):
        budget = _budget()
        budget.step()
        # a str method's string; the sandbox hands out str.format wrapped (the bound method is its __wrapped__)
        owner = getattr(obj, "__self__", None) or getattr(getattr(obj, "__wrapped__", None), "__self__", None)
        _check_arguments(getattr(obj, "__name__", ""), (owner, *args) if isinstance(owner, str) else args, kwargs)
        return budget.sized(ImmutableSandboxedEnvironment.call(env, context, obj, *args, **kwargs))

    env.call_binop, env.call = call_binop, call  # the compiled template calls environment.call(...) for every call
    return env


def _filtered(node, name: str):
    from jinja2 import nodes

    return nodes.Filter(node, name, [], [], None, None, lineno=getattr(node, "lineno", 1) or 1)


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    """The template compiled with every loop's iterable, concatenation and ``{% set %}`` block counted and checked."""
    from jinja2.visitor import NodeTransformer
    from transformers.utils.chat_template_utils import _compile_jinja_template

    class Bounded(NodeTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = _filtered(node.iter, STEPS_FILTER)
            return node

        def visit_Concat(self, node):
            return _filtered(self.generic_visit(node), SIZED_FILTER)

        def visit_AssignBlock(self, node):
            node = self.generic_visit(node)
            node.filter = _filtered(node.filter, SIZED_FILTER)  # None: the block's text itself
            return node

    # transformers' environment, taken from an empty template: compiling this one there would fold its constant
    # expressions unchecked ('x' * 10**10 is computed while compiling)
    env = _bounded_environment(_compile_jinja_template("").environment)
    return env.from_string(Bounded().visit(env.parse(template)))


def template_file(tokenizer) -> str:
    """The file a tokenizer's chat template came from, as the refusals name it."""
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or "."))
    for name in TEMPLATE_FILES:
        if (folder / name).is_file():
            return str(folder / name)
    return f"the chat template of {folder}"


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=...)``, the same text,
    rendered within the module's bounds; a template that passes one, or that fails, is refused naming its file."""
    import jinja2

    budget = _Budget(sum(len(str(m.get("content", ""))) for m in messages))
    token = _BUDGET.set(budget)
    try:
        template = _compiled(tokenizer.get_chat_template())
        pieces, size = [], 0
        for piece in template.generate(messages=messages, tools=None, documents=None,
                                       add_generation_prompt=add_generation_prompt, **tokenizer.special_tokens_map):
            size += len(piece)
            budget.refuse_larger(size, "an output")
            pieces.append(piece)
        return "".join(pieces)
    except _OverBudget as e:
        raise _refusal(tokenizer, f"it was stopped after {e}; a chat template renders a conversation in a few "
                       "hundred steps and milliseconds, so this one loops or grows without end") from None
    except (MemoryError, RecursionError) as e:
        raise _refusal(tokenizer, f"it {'ran out of memory' if isinstance(e, MemoryError) else 'recursed too deeply'}"
                       " while rendering") from None
    except jinja2.exceptions.SecurityError as e:
        raise _refusal(tokenizer, f"it does what the template sandbox forbids ({e}); templates are rendered in "
                       "transformers' sandbox, which keeps them from reaching Python") from None
    except jinja2.exceptions.TemplateError as e:
        raise _refusal(tokenizer, f"it failed: {type(e).__name__}: {e}") from None
    finally:
        _BUDGET.reset(token)


def _refusal(tokenizer, why: str) -> UserError:
    return UserError(f"the chat template cannot be used: {why}", template_file(tokenizer),
                     "Use a model or run folder whose chat template you trust (a run folder keeps its base model's "
                     "template: fix or remove it there), or render prompts without it: data.template: plain in the "
                     "recipe (--set data.template=plain).")
