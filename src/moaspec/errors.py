"""User-facing errors: the CLI prints their message and exits non-zero, without a traceback."""


class UserError(Exception):
    """Bad input or environment that the user can fix; the message says how."""


class ContextLengthError(UserError):
    """A prompt or generation that does not fit the model's context."""
