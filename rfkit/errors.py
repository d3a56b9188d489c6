"""User-facing errors: each message is one line that names the field and what is allowed."""


def one_line(message) -> str:
    """``message`` with its whitespace (newlines included) collapsed: one line for the user."""
    return " ".join(str(message).split())


class RFKitError(ValueError):
    """Base of rfkit's user-facing errors; the CLI prints the message alone and exits 2."""


class OutputError(RFKitError):
    """An output location that cannot be written (a parent that is a file, a read-only or
    virtual file system); found by a preflight that creates nothing."""


class DiskFullError(RFKitError, OSError):
    """The disk filled up while rfkit wrote an output. Nothing partial is left behind (writes go
    through :mod:`rfkit.atomic`). Also an ``OSError`` with ``errno`` ENOSPC, so code that
    tolerates failed cache writes (``except OSError``) still does."""

    def __str__(self) -> str:  # the message alone, not OSError's "[Errno 28] ..." form
        return str(self.args[0]) if self.args else ""


class ParseError(SystemExit):
    """A recipe or command line that does not parse; the message is one line naming the field.

    A SystemExit (code 2), not an RFKitError: jsonargparse catches ValueError and TypeError while
    it tries the other types of a union, and a parse error must pass through that untouched.
    :mod:`rfkit.cli` prints it. Raised by ``rfkit.config.lightning_cli.RFArgumentParser``.
    """

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message
