"""Reading what someone else wrote on the board: the one bounded reader of a board value.

Owns: turning what was read from the board (a field's bytes or text, a JSON record, a number in a decoded
record) into an int, a float or a JSON value within stated bounds, and the one error for a value that is
not one: :class:`BoardValueError`, a ``ValueError``. Whoever can write to the board's Redis may have written
anything: a 400-digit integer, ``1e400``, ``NaN``, a megabyte of digits, JSON nested ten thousand deep. Each
reads as a data error the caller skips, waits out or refuses, never as an ``OverflowError``, a
``RecursionError`` or a number that is not finite let through to a sum, a sleep or a comparison.

A JSON record read here holds only finite floats and integers within a float's range (a number beyond reads
as null), and a JSON config only finite floats and integers within :data:`MAX_INT` of zero (else it is
refused): decided once, here, not again at each number by each reader.

Must never: touch Redis, or let through a number that is not finite or beyond its bounds.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_INT = 2**63 - 1
"""largest integer (by magnitude) a board value may hold: a signed 64-bit one, what Redis counts in"""
_MAX_DIGITS = 20
"""the most characters of an integer within :data:`MAX_INT` (19 digits, and a sign)"""
_FLOAT_DIGITS = 310
"""the most characters of an integer within a float's range (309 digits, and a sign)"""
_MAX_NUMBER_TEXT = 64
"""the most characters of a field that holds a number"""


class BoardValueError(ValueError):
    """A value read from the board is not what it must be (not a number, beyond its bounds, not finite, too
    large, not JSON): a data error for the reader to skip or refuse, never a crash."""


def shown(value: object, limit: int = 40) -> str:
    """``value`` for an error message, cut: a huge integer by its size, never its digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _text(value: object, limit: int) -> str | None:
    """A field's bytes or text as text of at most ``limit`` characters, else None."""
    if isinstance(value, bytes):
        if len(value) > limit:
            return None
        try:
            return value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if isinstance(value, str):
        return value if len(value) <= limit else None
    return None


def integer(value: object, name: str, low: int = 0, high: int = MAX_INT) -> int:
    """``value`` (a field's bytes or text, or an int of a decoded record) as an int in [low, high]."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        text = _text(value, _MAX_DIGITS + 2)
        if text is not None:
            try:
                number = int(text)
            except ValueError:
                number = None
    if number is None or not low <= number <= high:
        raise BoardValueError(f"{name} holds {shown(value)}; expected an integer in {low}..{high}")
    return number


def optional_integer(value: object, name: str, low: int = 0, high: int = MAX_INT) -> int | None:
    """Like :func:`integer`; None for a missing or empty value."""
    return None if value is None or value in (b"", "") else integer(value, name, low, high)


def number(value: object, name: str, low: float = 0.0, high: float = 1e12) -> float:
    """``value`` (a field's bytes or text, or a number of a decoded record) as a finite float in [low, high]."""
    found = finite(value)
    if found is None and not isinstance(value, (int, float)):
        text = _text(value, _MAX_NUMBER_TEXT)
        if text is not None:
            try:
                found = finite(float(text))  # "inf", "nan", "1e400" (inf) are not finite: refused
            except ValueError:
                found = None
    if found is None or not low <= found <= high:
        raise BoardValueError(f"{name} holds {shown(value)}; expected a number in {low:g}..{high:g}")
    return found


def optional_number(value: object, name: str, low: float = 0.0, high: float = 1e12) -> float | None:
    """Like :func:`number`; None for a missing or empty value."""
    return None if value is None or value in (b"", "") else number(value, name, low, high)


def finite(value: object) -> float | None:
    """A number of a decoded record as a finite float; None for anything else (a bool, a text, a missing
    value, an integer beyond a float's range, a float that is not finite). Never raises."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond a float's range: math.isfinite would raise the same
        return None
    return number if math.isfinite(number) else None


def _null(text: str) -> None:
    return None


def _float_or_null(text: str) -> float | None:
    number = float(text)
    return number if math.isfinite(number) else None  # "1e400"


def _int_or_null(text: str) -> int | None:
    if len(text) > _FLOAT_DIGITS:  # beyond a float's range: never converted, however long
        return None
    number = int(text)
    return number if finite(number) is not None else None


def _refuse_constant(text: str) -> Any:
    raise BoardValueError(f"holds {text}; expected finite numbers only")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):  # "1e400"
        raise BoardValueError(f"holds {text[:40]}; expected finite numbers only")
    return number


def _bounded_int(text: str) -> int:
    if len(text) > _MAX_DIGITS or not -MAX_INT <= (number := int(text)) <= MAX_INT:
        raise BoardValueError(f"holds an integer of {len(text.lstrip('-'))} digits; expected at most {MAX_INT}")
    return number


def _loads(raw: bytes | str, name: str, limit: int, parse: dict[str, Any]) -> Any:
    if not isinstance(raw, (bytes, str)):
        raise BoardValueError(f"{name} holds {type(raw).__name__}; expected JSON text")
    if len(raw) > limit:
        raise BoardValueError(f"{name} is {len(raw)} bytes; at most {limit} are read")
    try:
        return json.loads(raw, **parse)
    except BoardValueError as e:
        raise BoardValueError(f"{name} {e}") from None
    except RecursionError:
        raise BoardValueError(f"{name} is JSON nested too deep") from None
    except ValueError as e:  # not JSON, not UTF-8
        raise BoardValueError(f"{name} is not JSON ({str(e)[:80]})") from None


def json_record(raw: bytes | str, name: str, limit: int) -> Any:
    """``raw`` (at most ``limit`` bytes or characters) as a JSON value: a record nodes write (counters, stats,
    an event, a history row, a refusal, a dead letter, a ledger). A number in it that no reader could hold (not
    finite: ``NaN``, ``1e400``; an integer beyond a float's range) reads as null: that value is the data error,
    and the rest of the record stands (a trainer's diverged loss must not hide its stats)."""
    return _loads(raw, name, limit, {"parse_int": _int_or_null, "parse_float": _float_or_null,
                                     "parse_constant": _null})


def json_object(raw: bytes | str, name: str, limit: int) -> dict[str, Any]:
    """Like :func:`json_record`, for a JSON object."""
    found = json_record(raw, name, limit)
    if not isinstance(found, dict):
        raise BoardValueError(f"{name} must be a JSON object, found {type(found).__name__}")
    return found


def json_config(raw: bytes | str, name: str, limit: int) -> dict[str, Any]:
    """``raw`` (at most ``limit`` bytes or characters) as a JSON object whose numbers are all finite and within
    :data:`MAX_INT` of zero, else :class:`BoardValueError`: a config, where a number read as null would change
    its meaning (a ``max_train_count`` of null is no limit)."""
    found = _loads(raw, name, limit, {"parse_int": _bounded_int, "parse_float": _finite_float,
                                      "parse_constant": _refuse_constant})
    if not isinstance(found, dict):
        raise BoardValueError(f"{name} must be a JSON object, found {type(found).__name__}")
    return found
