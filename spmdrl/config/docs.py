"""Field docstrings, the TOML dump of a resolved config, and the generated docs/config.md."""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json

from .loader import _fields, _sections, _type_name
from .schema import Config, SFTSection


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """The string literal under each field of a dataclass (Python drops them at runtime; ast keeps them)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        # A JSON string literal is a TOML basic string, given raw non-ASCII (JSON's surrogate-pair escapes of
        # characters beyond the BMP are invalid TOML) and DEL escaped (TOML forbids it raw).
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, float):
        r = repr(v)
        return r if any(c in r for c in ".enI") else r + ".0"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def to_toml(cfg, with_docs: bool = False) -> str:
    """The resolved config as TOML, valid input to --config. None values are left out (they are defaults)."""
    lines = []
    for sec_field in dataclasses.fields(cfg):
        sec = getattr(cfg, sec_field.name)
        docs = field_docs(type(sec))
        lines.append(f"[{sec_field.name}]")
        for f in dataclasses.fields(sec):
            v = getattr(sec, f.name)
            if v is None:
                continue
            if with_docs and f.name in docs:
                lines.append(f"# {docs[f.name]}")
            lines.append(f"{f.name} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def config_reference(root_cls=Config) -> str:
    """docs/config.md: one table per section, from the dataclasses and their field docstrings."""
    out = [
        "# Config reference",
        "",
        "Generated from `spmdrl/config/schema.py` by `spmdrl config docs`; do not edit by hand "
        "(a test fails when this file is stale).",
        "",
        "A run is configured by a TOML file (`--config F.toml`) with one table per section below, "
        "`extends = \"base.toml\"` to inherit from other files (paths relative to the file, child wins), "
        "and command-line overrides `section.key=value`.",
        "",
    ]
    for name, sec_cls in _sections(root_cls).items():
        out += _section_table(name, sec_cls)
    if root_cls is Config:
        out += [
            "## The SFT warm start (`spmdrl sft`)",
            "",
            "An SFT config (`spmdrl sft --config F`, `python -m spmdrl.sft`) has the sections [model], [placement], "
            "[trainer] and [logging] above (of [trainer], the warm start reads seed, output_dir and device) and "
            "[sft] below; `spmdrl config show` prints one (a file with an [sft] table is read as an SFT config). "
            "Guide: [sft.md](sft.md).",
            "",
        ]
        out += _section_table("sft", SFTSection, level="###")
    return "\n".join(out)


def _section_table(name: str, sec_cls, level: str = "##") -> list[str]:
    out = [f"{level} [{name}]", "", " ".join((sec_cls.__doc__ or "").split()), ""]
    out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    docs = field_docs(sec_cls)
    default = sec_cls()
    for fname, ftype in _fields(sec_cls):
        d = getattr(default, fname)
        shown = _toml_value(d) if d is not None else "(none)"
        out.append(
            f"| `{fname}` | {_type_name(ftype).replace('|', '&#124;')} | `{shown}` "
            f"| {docs.get(fname, '').replace('|', '&#124;')} |"
        )
    out.append("")
    return out


def missing_docs(root_cls=Config) -> list[str]:
    """Fields without a docstring (a test keeps this empty)."""
    missing = []
    sections = _sections(root_cls)
    if root_cls is Config:
        sections["sft"] = SFTSection
    for name, sec_cls in sections.items():
        docs = field_docs(sec_cls)
        missing += [f"{name}.{f.name}" for f in dataclasses.fields(sec_cls) if f.name not in docs]
    return missing


def converted_toml(sections: dict, notes: list[str]) -> str:
    """A converted config (spmdrl.config.verl.from_verl: {section: {key: value}} and notes) as TOML, checked
    against the schema (names and types), the notes as comments on top."""
    import typing

    from .loader import build

    for sec, values in sections.items():  # verl takes one path where spmdrl keeps a list
        hints = typing.get_type_hints(_sections(Config)[sec])
        for k, v in values.items():
            if typing.get_origin(hints.get(k)) is list and not isinstance(v, list):
                values[k] = [v]
    build(sections, {s: "the converted verl config" for s in sections})  # a wrong type names the key
    lines = ["# converted from verl by `spmdrl config from-verl`; check every value, then `spmdrl config show --config F`"]
    lines += [f"# {n}" for n in notes]
    for sec, values in sections.items():
        lines += ["", f"[{sec}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


__all__ = ["config_reference", "converted_toml", "field_docs", "missing_docs", "to_toml"]
