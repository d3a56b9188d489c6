"""User-facing errors: each message is one line that names the field and what is allowed."""


class RFKitError(ValueError):
    """Base of rfkit's user-facing errors; the CLI prints the message alone and exits 2."""
