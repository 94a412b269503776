"""TOML -> typed config: `extends` inheritance, `section.key=value` overrides, type checks.

Everything here runs before any process group, model or engine exists, and every error names the
offending key and file.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import tomllib
import types
import typing
from typing import Any

from spmdrl.errors import ConfigError

from .schema import Config

OVERRIDE = "command-line override"


def _sections(root_cls) -> dict[str, type]:
    return dict(_fields(root_cls))


def _fields(cls) -> list[tuple[str, Any]]:
    """(name, resolved type) of each dataclass field."""
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]


def _closest(name: str, choices) -> str:
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(choices))}"


def _type_name(tp) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp, key: str, where: str, from_string: bool = False) -> Any:
    """Check `value` against the field type `tp` (and convert CLI strings); raise ConfigError naming key."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (from_string and str(value).lower() in ("none", "null")):
            if type(None) in args:
                return None
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, key, where, from_string)
            except ConfigError:
                pass
        raise _type_error(key, tp, value, where)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if from_string and isinstance(value, str):
            text, value = value, _parse_cli_value(value, key, where)
            if not isinstance(value, list):  # `rollout.stop=0` means the string "0"; `x="a"` the string a
                quoted = isinstance(value, str) and text.strip()[:1] in ("'", '"')
                value = [(value if quoted else text) if item_tp is str else value]
            from_string = False  # the items are typed TOML values now; do not parse them again
        if not isinstance(value, list):
            raise _type_error(key, tp, value, where)
        return [coerce(v, item_tp, f"{key}[{i}]", where, from_string) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_string and isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise _type_error(key, tp, value, where)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_string and isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise _type_error(key, tp, value, where)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_string and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise _type_error(key, tp, value, where)
    if tp is str:
        if from_string and isinstance(value, str) and value[:1] in ("'", '"'):
            parsed = _parse_cli_value(value, key, where)  # a quoted TOML string, as inside lists
            return parsed if isinstance(parsed, str) else value
        if isinstance(value, str):
            return value
        raise _type_error(key, tp, value, where)
    raise ConfigError(f"{where}: key '{key}' has unsupported type {tp}")  # a schema bug, not user error


def _type_error(key, tp, value, where) -> ConfigError:
    hint = ""
    if typing.get_origin(tp) is list and not isinstance(value, list):
        hint = f"; write a list, e.g. {key} = [{json.dumps(value) if isinstance(value, (str, int, float)) else '...'}]"
    return ConfigError(
        f"{where}: key '{key}' expects {_type_name(tp)}, found {value!r} ({type(value).__name__}){hint}"
    )


def _parse_cli_value(text: str, key: str, where: str):
    """Parse an override's value as a TOML value; bare words fall back to strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        if text.startswith("["):
            raise ConfigError(f"{where}: cannot parse list value {text!r} for '{key}'; use TOML syntax, e.g. [1, 2] or [\"a\"]") from None
        return text


def read_toml_tree(path: str, _chain: tuple[str, ...] = ()) -> tuple[dict, dict[str, str]]:
    """Read `path` and the files it `extends`, merged (child wins). Returns (data, origin of each key)."""
    path = os.path.abspath(path)
    if path in _chain:
        cycle = " -> ".join(os.path.relpath(p) for p in (*_chain, path))
        raise ConfigError(f"{path}: 'extends' cycle: {cycle}; remove one of the links")
    if os.path.isdir(path):
        tomls = sorted(f for f in os.listdir(path) if f.endswith(".toml"))[:5]
        there = f" (it holds {', '.join(tomls)})" if tomls else ""
        raise ConfigError(f"config {path} is a directory{there}; give a TOML file, e.g. --config {path}/"
                          f"{tomls[0] if tomls else 'run.toml'}")
    if not os.path.isfile(path):
        where = f" (extended by {_chain[-1]})" if _chain else ""
        raise ConfigError(f"config file not found: {path}{where}; check the path")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    parents = data.pop("extends", [])
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"{path}: 'extends' must be a path string or a list of them, found {parents!r}")
    merged: dict = {}
    origin: dict[str, str] = {}
    for parent in parents:
        ppath = parent if os.path.isabs(parent) else os.path.join(os.path.dirname(path), parent)
        pdata, porigin = read_toml_tree(ppath, (*_chain, path))
        _merge(merged, pdata)
        origin.update(porigin)
    _merge(merged, data)
    for sec, val in data.items():
        origin[sec] = path  # names the file in 'unknown section' errors
        if isinstance(val, dict):
            for k in val:
                origin[f"{sec}.{k}"] = path
    return merged, origin


def _merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def build(data: dict, origin: dict[str, str], root_cls=Config):
    """Typed root dataclass from a nested dict; unknown keys and wrong types name key and file."""
    sections = _sections(root_cls)
    kwargs = {}
    for sec, val in data.items():
        where = origin.get(sec, "config")
        if sec not in sections:
            raise ConfigError(f"{where}: unknown section '{sec}'{_closest(sec, sections)}")
        if not isinstance(val, dict):
            raise ConfigError(f"{where}: '{sec}' must be a table [{sec}], found {val!r}")
    for sec, sec_cls in sections.items():
        val = data.get(sec, {})
        fields = dict(_fields(sec_cls))
        sec_kwargs = {}
        for k, v in val.items():
            key = f"{sec}.{k}"
            where = origin.get(key, "config")
            if k not in fields:
                hint = _closest(k, fields).replace("'", f"'{sec}.", 1) if difflib.get_close_matches(k, list(fields), n=1, cutoff=0.5) else _closest(k, fields)
                raise ConfigError(f"{where}: unknown key '{key}'{hint}")
            sec_kwargs[k] = coerce(v, fields[k], key, where, from_string=origin.get(key) == OVERRIDE)
        kwargs[sec] = sec_cls(**sec_kwargs)
    return root_cls(**kwargs)


def parse_overrides(overrides: list[str]) -> tuple[dict, dict[str, str]]:
    data: dict = {}
    origin: dict[str, str] = {}
    for item in overrides:
        item = item[2:] if item.startswith("--") else item
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) != 2 or not all(parts) or key.startswith("+"):
            from spmdrl.config.verl import override_hint

            raise ConfigError(f"override {item!r}: {override_hint(key.strip())}")
        data.setdefault(parts[0], {})[parts[1]] = value.strip()
        origin[key.strip()] = OVERRIDE
        origin.setdefault(parts[0], OVERRIDE)
    return data, origin


def load_config(path: str | None = None, overrides: list[str] | None = None, root_cls=Config):
    """Read a TOML file (following `extends`) and apply command-line overrides; type-checked, not validated."""
    data, origin = read_toml_tree(path) if path else ({}, {})
    odata, oorigin = parse_overrides(list(overrides or []))
    _merge(data, odata)
    origin.update(oorigin)
    return build(data, origin, root_cls)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
