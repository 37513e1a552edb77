"""User-facing errors: one paragraph, exit code 2, no traceback (``--debug`` shows it)."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix: says what was wrong, where, and what to do.

    The CLI prints ``str(err)`` as one paragraph and exits with ``exit_code``.
    """

    exit_code = 2

    def __init__(self, what: str, where: str | None = None, fix: str | None = None):
        self.what, self.where, self.fix = what, where, fix
        text = f"{where}: {what}" if where else what
        if not text.rstrip().endswith((".", "?", "!")):
            text = text.rstrip() + "."
        super().__init__(f"{text} {fix}" if fix else text)


class VerificationError(Exception):
    """A result failed its own check (e.g. a merged model differs from base + adapter): exit code 1."""

    exit_code = 1
