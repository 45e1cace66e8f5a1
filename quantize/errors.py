"""Errors the CLI turns into one line and an exit code.

Exit codes: 0 success, 1 the job failed on its input or environment, 2 the request itself is invalid
(bad option, recipe or scheme that cannot apply to this checkpoint, OUT exists).
"""


class QuantizeError(Exception):
    """A failure the user can act on; the message says what was expected, what was found and the fix."""

    exit_code = 1


class UsageError(QuantizeError):
    """The request cannot be carried out as asked (option, recipe, destination)."""

    exit_code = 2
