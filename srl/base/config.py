"""Typed configuration dataclasses as plain data (JSON-able dicts), both ways.

Owns: turning a config dataclass into a dict and back, with errors that name
the field. Must never: evaluate code or import classes named in the data.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")
_MAX_INT = 2**63 - 1


class ConfigError(ValueError):
    """A configuration cannot be built from the data given."""


@functools.cache
def _setting_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def unknown_setting_message(cls: type, name: str) -> str:
    """What to say about a setting ``name`` that ``cls`` (a dataclass) does not have."""
    known = sorted(_setting_names(cls))
    close = difflib.get_close_matches(name, known, n=1) if len(name) <= 64 else []
    if not close:  # "lr_typo": a setting with a word stuck to it
        close = sorted((k for k in known if name.startswith(k + "_") or k.startswith(name + "_")), key=len)[-1:]
    hint = f"; did you mean {close[0]!r}?" if close else f"; its settings are {', '.join(known)}"
    owner = cls.__qualname__ if cls.__qualname__ != "Config" else f"{cls.__module__.rpartition('.')[2]}.Config"
    return f"{owner} has no setting {_short(name, 70)}{hint}"


class Settings:
    """A settings dataclass whose attributes are its fields: assigning any other name (a typo such as
    ``config.lr_typo = 1`` or ``config.memory.capcity = 10``) raises AttributeError with the closest
    field, instead of adding an attribute that nothing reads. Names starting with ``_`` stay free."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and dataclasses.is_dataclass(self) \
                and name not in _setting_names(type(self)):
            raise AttributeError(unknown_setting_message(type(self), name))
        super().__setattr__(name, value)


def config_to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass instance as a JSON-able dict (nested dataclasses become dicts)."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"expected a dataclass instance, got {type(obj).__name__}")
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        out[f.name] = _to_data(getattr(obj, f.name))
    return out


def setting_data(value: Any) -> Any:
    """One setting's value as ``config_to_dict`` stores it (a nested config as a dict, tuples as lists)."""
    return _to_data(value)


def _to_data(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return config_to_dict(value)
    if isinstance(value, (list, tuple)):
        return [_to_data(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_data(v) for k, v in value.items()}
    return value


def config_from_dict(cls: type[T], data: dict[str, Any], *, where: str = "") -> T:
    """Build ``cls`` from ``data``; unknown or mistyped fields raise :class:`ConfigError`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__}: expected an object of fields, got {type(data).__name__}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        path = f"{where}.{name}" if where else f"{cls.__name__}.{name}"
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1) if len(str(name)) <= 64 else []
            hint = f"; did you mean {close[0]!r}?" if close else f"; known fields: {sorted(fields)}"
            raise ConfigError(f"{_short(path, 120)}: no such field in {cls.__name__}{hint}")
        kwargs[name] = _from_data(hints[name], value, path)
    return cls(**kwargs)


def _from_data(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if origin is Union or (hasattr(types, "UnionType") and isinstance(tp, types.UnionType)):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _from_data(arg, value, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{path}: {_short(value)} fits none of {tp}: {errors}")
    if origin is typing.Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{path}: expected one of {list(get_args(tp))}, got {_short(value)}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return config_from_dict(tp, value, where=path)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        args = get_args(tp)
        item_tp = args[0] if args else Any
        items = [_from_data(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected an object, got {type(value).__name__}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {_short(value)}")
        if isinstance(value, int) and abs(value) > _MAX_INT:
            raise ConfigError(f"{path}: {_short(value)} is out of range")
        if not math.isfinite(value):
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {_short(value)}")
        if abs(value) > _MAX_INT:
            raise ConfigError(f"{path}: {_short(value)} is out of range (at most 2**63-1)")
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            raise ConfigError(f"{path}: expected {tp.__name__}, got {_short(value)}")
        return value
    return value


def shown(value: Any, limit: int = 40) -> str:
    """A value for an error message: its repr, cut, with its type where the repr hides it ("'0.001' (a
    str)", "1000.0 (a float)", "True (a bool)"), so a value that merely looks right says what it is."""
    text = _short(value, limit)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or isinstance(value, float):
        kind = type(value).__name__
        text += f" (an {kind})" if kind[:1] in "aeiou" else f" (a {kind})"
    return text


def _short(value: Any, limit: int = 80) -> str:
    """A value's repr, cut (configs may come from an untrusted board)."""
    big = isinstance(value, int) and abs(value) >= 10**30
    text = f"an integer of {value.bit_length()} bits" if big else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_int(name: str, value: object, low: int, high: int) -> None:
    """Raise ValueError unless ``value`` is an int in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in {low}..{high}, got {shown(value)}")


def check_number(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> None:
    """Raise ValueError unless ``value`` is a finite number in [low, high] ((low, high] with ``low_open``)."""
    # an int is finite whatever its size (math.isfinite would raise OverflowError on one beyond a float's range)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (isinstance(value, int)
                                                                             or math.isfinite(value))
    if ok and (value < low or value > high or (low_open and value == low)):  # type: ignore[operator]
        ok = False
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be a finite number in {bracket}{low:g}, {high:g}], got {shown(value)}")
