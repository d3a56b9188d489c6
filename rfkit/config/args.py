"""Command-line parsing shared by rfkit's argparse commands: one-line errors and the value parsers.

:class:`OneLineParser` raises its errors (one line, no usage dump) for :mod:`rfkit.cli` to print
with exit code 2. The ``parse_*`` functions read one kind of comma-separated or sized value; each
takes the flag (named in every message) and the error class to raise.

Imports only the standard library and :mod:`rfkit.errors` (no torch), so ``rfkit recipes`` and
``--help`` stay fast.
"""

from __future__ import annotations

import argparse
import functools
import re

from rfkit.errors import RFKitError


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are raised as ``error_class`` with one line (no usage dump), for
    :mod:`rfkit.cli` to print with exit code 2.

    ``error_class`` and ``value_hints`` (flag -> text added to ``FLAG: needs a value``) are class
    attributes that a subclass may set, or keyword arguments; subparsers inherit both.
    """

    error_class: type[RFKitError] = RFKitError
    value_hints: dict[str, str] = {}

    def __init__(self, *args, error_class: type[RFKitError] | None = None, value_hints: dict[str, str] | None = None, **kw):
        super().__init__(*args, **kw)
        if error_class is not None:
            self.error_class = error_class
        if value_hints is not None:
            self.value_hints = value_hints

    def add_subparsers(self, **kw):
        kw.setdefault(
            "parser_class", functools.partial(type(self), error_class=self.error_class, value_hints=self.value_hints)
        )
        return super().add_subparsers(**kw)

    def explain(self, message: str) -> str:
        """The one line for argparse's ``message`` (whitespace already collapsed)."""
        found = re.fullmatch(r"argument (\S+?)(?:/\S+)?: expected one argument", message)
        if found:
            hint = self.value_hints.get(found.group(1), "")
            message = f"{found.group(1)}: needs a value{hint}"
        return message

    def error(self, message):
        raise self.error_class(self.explain(" ".join(message.split())))


def parse_lengths(
    text: str, flag: str = "--lengths", *, example: str = "1024,10240", error=RFKitError, noun: str = "lengths"
) -> list[int]:
    """``"1024,10240"`` -> ``[1024, 10240]`` (``_`` allowed as a digit separator); anything but
    positive integers is ``error``, with ``example`` as the suggestion."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise error(f"{flag}: give at least one positive integer, like {example}")
    values = []
    for part in parts:
        try:
            value = int(part.replace("_", ""))
        except ValueError:
            raise error(f"{flag}: '{part}' is not an integer; give positive integers like {example}") from None
        if value <= 0:
            raise error(f"{flag}: {noun} must be positive integers, got {value}")
        values.append(value)
    return values


def parse_fractions(text: str, flag: str, *, noun: str, outside: str, error=RFKitError) -> list[float]:
    """``"0,0.5,1"`` -> ``[0.0, 0.5, 1.0]`` in the order given; each must be a number in [0, 1].
    ``noun`` names one value in the messages (``fraction``, ``depth``); ``outside`` is the
    message for a number outside [0, 1], a template with ``{flag}``, ``{value}`` (the float) and
    ``{part}`` (the text as given)."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise error(f"{flag}: give at least one {noun} in [0, 1], like 0,0.5,1")
    values = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            raise error(f"{flag}: '{part}' is not a number; give {noun}s in [0, 1] like 0,0.5,1") from None
        if not 0.0 <= value <= 1.0:  # also rejects nan
            raise error(outside.format(flag=flag, value=value, part=part))
        values.append(value)
    return values


def parse_betas(text: str, flag: str = "--betas", *, error=RFKitError) -> list[float]:
    """``"0,0.5,1"`` -> ``[0.0, 0.5, 1.0]``: fractions of heads replaced, sorted, duplicates dropped."""
    outside = "{flag}: {value} is outside [0, 1]; beta is the fraction of heads replaced"
    return sorted(set(parse_fractions(text, flag, noun="fraction", outside=outside, error=error)))


def parse_depths(text: str, flag: str = "--depths", *, error=RFKitError) -> list[float]:
    """``"0,0.5,1"`` -> ``[0.0, 0.5, 1.0]``: positions in a prompt (0 = start, 1 = end), as given."""
    outside = "{flag}: depths must be in [0, 1] (0 = start, 1 = end), got {part}"
    return parse_fractions(text, flag, noun="depth", outside=outside, error=error)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str, flag: str = "--max-input", *, error=RFKitError) -> int:
    """``"512MiB"``, ``"2GB"``, ``"1000000"`` -> bytes (a positive budget)."""
    found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not found or found.group(2).lower() not in _UNITS:
        raise error(f"{flag}: '{text}' is not a byte budget; give a number with an optional unit, like 512MiB or 2GB")
    value = int(float(found.group(1)) * _UNITS[found.group(2).lower()])
    if value <= 0:
        raise error(f"{flag}: the budget must be positive, got '{text}'")
    return value
