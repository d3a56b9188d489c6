"""Small validators for user-facing settings; each failure is one line that names the field.

Every validator returns the value it checked and raises ``error(message)``: ``error`` is an
exception class (default :class:`~rfkit.errors.RFKitError`) or any callable that builds the
exception from the message. ``message`` is a :meth:`str.format` template, so each caller keeps
its own wording; the fields are ``field``, ``value`` (``{value!r}`` for its repr), ``null``
(``" or null"`` when ``optional``, else empty) and the bounds: ``minimum`` for integers;
``low``, ``high``, ``interval`` (``[0, 1)``) and ``bounds`` (``>= 0``, ``in (0, 1]``) for
numbers; ``allowed`` (comma separated) for choices.

Booleans are never integers or numbers here. Imports only the standard library and
:mod:`rfkit.errors`.
"""

from __future__ import annotations

import math

from rfkit.errors import RFKitError

INTEGER = "{field}: must be an integer >= {minimum}{null}, got {value!r}"
INTEGER_NOT_ALLOWED = "{field}: {value!r} is not allowed; must be an integer >= {minimum}{null}"
POSITIVE_INTEGER = "{field}: must be a positive integer, got {value}"
NUMBER_NOT_ALLOWED = "{field}: {value!r} is not allowed; must be a number {bounds}{null}"
BOOLEAN = "{field}: {value!r} is not allowed; give true or false"
ONE_OF = "{field}: {value!r} is not allowed; allowed: {allowed}"


def is_int(value) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fail(error, message: str, **fields):
    raise error(message.format(**fields))


def integer(field: str, value, minimum: int | None = None, *, multiple_of: int = 1, optional: bool = False,
            error=RFKitError, message: str = INTEGER):  # fmt: skip
    """``value`` must be an integer (>= ``minimum`` when given, a multiple of ``multiple_of``);
    ``None`` passes when ``optional``."""
    if optional and value is None:
        return None
    ok = is_int(value) and (minimum is None or value >= minimum) and value % multiple_of == 0
    if not ok:
        _fail(error, message, field=field, value=value, minimum=minimum, null=" or null" if optional else "")
    return value


def positive_int(field: str, value, minimum: int = 1, *, multiple_of: int = 1, optional: bool = False,
                 error=RFKitError, message: str = INTEGER):  # fmt: skip
    """``value`` must be an integer >= ``minimum`` (1 unless told); see :func:`integer`."""
    return integer(field, value, minimum, multiple_of=multiple_of, optional=optional, error=error, message=message)


def _number(x) -> str:
    return f"{x:g}"


def _interval(low, high, low_open: bool, high_open: bool) -> tuple[str, str]:
    """``(interval, bounds)``: ``("[0, 1)", "in [0, 1)")``, or ``("", ">= 0")`` for one bound."""
    if low is not None and high is not None:
        text = f"{'(' if low_open else '['}{_number(low)}, {_number(high)}{')' if high_open else ']'}"
        return text, f"in {text}"
    if low is not None:
        return "", f"{'>' if low_open else '>='} {_number(low)}"
    if high is not None:
        return "", f"{'<' if high_open else '<='} {_number(high)}"
    return "", "a number"


def in_range(field: str, value, low: float | None = None, high: float | None = None, *, low_open: bool = False,
             high_open: bool = False, finite: bool = False, optional: bool = False, error=RFKitError,
             message: str = NUMBER_NOT_ALLOWED):  # fmt: skip
    """``value`` must be a number within ``low`` .. ``high`` (either may be None; ``*_open``
    excludes the bound; NaN never passes; ``finite`` also refuses infinities); ``None`` passes
    when ``optional``."""
    if optional and value is None:
        return None
    ok = is_number(value) and not (finite and not math.isfinite(value))
    ok = ok and (low is None or (value > low if low_open else value >= low))
    ok = ok and (high is None or (value < high if high_open else value <= high))
    if not ok:
        interval, bounds = _interval(low, high, low_open, high_open)
        _fail(error, message, field=field, value=value, low=low, high=high, interval=interval, bounds=bounds,
              null=" or null" if optional else "")  # fmt: skip
    return value


def fraction(field: str, value, *, low_open: bool = False, high_open: bool = False, optional: bool = False,
             error=RFKitError, message: str = NUMBER_NOT_ALLOWED):  # fmt: skip
    """``value`` must be a number in [0, 1] (ends excluded as told); see :func:`in_range`."""
    return in_range(field, value, 0, 1, low_open=low_open, high_open=high_open, optional=optional, error=error,
                    message=message)  # fmt: skip


def boolean(field: str, value, *, error=RFKitError, message: str = BOOLEAN) -> bool:
    """``value`` must be ``True`` or ``False`` (not 0, 1 or a string)."""
    if not isinstance(value, bool):
        _fail(error, message, field=field, value=value)
    return value


def one_of(field: str, value, allowed, *, error=RFKitError, message: str = ONE_OF):
    """``value`` must be one of ``allowed``."""
    if value not in allowed:
        _fail(error, message, field=field, value=value, allowed=", ".join(str(a) for a in allowed))
    return value
