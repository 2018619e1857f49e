"""Configs: dataclasses, filled from a YAML file and dotted command-line overrides.

    kilovla train --config run.yaml --optim.lr=1e-4 --dataset.roots=[data/a,data/b]

Values of overrides are read as YAML scalars/lists (`1e-4`, `true`, `[a, b]`); each is checked
against the field's type. A key that does not exist stops with a suggestion:
"unknown config key 'optim.lrr' (did you mean 'optim.lr'?)".
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

from kilovla.errors import KilovlaError


def _all_keys(cls, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            out += _all_keys(hint, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def _unknown(cls, key: str, also: tuple[str, ...] = (), prefix: str = "") -> KilovlaError:
    """`also`: further keys the caller accepts (a command's own spellings), suggested like the config's;
    `prefix`: where `cls` sits in the caller's config (`key` includes it)."""
    keys = [prefix + k for k in _all_keys(cls)] + list(also)
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(keys)}"
    return KilovlaError(f"unknown config key {key!r}{hint}")


def _kind(hint) -> str:
    """A type as a message names it: 'an int', 'a float', 'an int or None'."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join("None" if a is type(None) else _kind(a) for a in typing.get_args(hint))
    name = getattr(hint, "__name__", str(hint))
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _coerce(value: Any, hint, key: str):
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except KilovlaError:
                continue
        raise KilovlaError(f"config key {key!r}: {value!r} is not {_kind(hint)}")
    if hint is Any:
        return value
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            value = [value]
        inner = args[0] if args else Any
        items = [_coerce(v, inner, key) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise KilovlaError(f"config key {key!r}: expected a mapping, got {value!r}")
        return dict(value)
    if hint in (int, str, bool) and isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    raise KilovlaError(f"config key {key!r}: {value!r} is not {_kind(hint)}")


def from_dict(cls, data: dict, prefix: str = "", root=None):
    """Build a (nested) dataclass from a dict, checking every key and value."""
    root = root or cls
    if not isinstance(data, dict):
        raise KilovlaError(f"config section {prefix.rstrip('.') or '(top)'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise _unknown(root, f"{prefix}{key}")
        hint = hints[key]
        kwargs[key] = from_dict(hint, value, f"{prefix}{key}.", root) if dataclasses.is_dataclass(hint) \
            else _coerce(value, hint, f"{prefix}{key}")
    return cls(**kwargs)


def parse_override(text: str) -> tuple[str, Any]:
    body = text.removeprefix("--")
    if "=" not in body:
        raise KilovlaError(f"override {text!r} must look like --section.key=value")
    key, raw = body.split("=", 1)
    import yaml  # here, not at the top: models/presets.py imports this module's checks on machines without PyYAML

    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def set_dotted(data: dict, key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise KilovlaError(f"override {key!r}: {part!r} is not a section")
    node[parts[-1]] = value


def load_config(cls, path: str | Path | None = None, overrides: list[str] = ()):
    """YAML file (optional) + overrides -> a checked `cls` instance."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise KilovlaError(f"{path}: config file not found")
        import yaml

        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise KilovlaError(f"{path}: not valid YAML: {e}") from None
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(data, key, value)
    return from_dict(cls, data)


def to_dict(config) -> dict:
    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return clean(dataclasses.asdict(config))


def dump_yaml(config) -> str:
    import yaml

    return yaml.safe_dump(to_dict(config), sort_keys=False)
