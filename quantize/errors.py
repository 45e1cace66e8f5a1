"""Errors the CLI turns into one line and an exit code.

Exit codes: 0 success, 1 the job failed on its input or environment, 2 the request itself is invalid
(bad option, recipe or scheme that cannot apply to this checkpoint, OUT exists).
"""


class QuantizeError(Exception):
    """A failure the user can act on; the message says what was expected, what was found and the fix."""

    exit_code = 1

    def __str__(self) -> str:
        # one line by construction: names read from a hostile file may hold newlines or control characters
        return "".join(c if c.isprintable() else repr(c)[1:-1] for c in super().__str__())


class UsageError(QuantizeError):
    """The request cannot be carried out as asked (option, recipe, destination)."""

    exit_code = 2
