"""multi_turn.tools -> Tool objects, checked at config validation (before any process group or engine).

A spec is a built-in name (calculator, python, http_exec) or 'path/to/file.py:name' / 'package.module:name'
naming one of:
- a Tool (tools/base.py);
- a function of no required arguments, not annotated `-> str`, returning a Tool (a factory; called once);
- a plain typed function with a Google-style docstring, e.g.

      def add(a: int, b: int) -> str:
          \"\"\"Add two integers.

          Args:
              a: the first
              b: the second
          \"\"\"

  whose JSON schema is derived from its signature and docstring by transformers' `get_json_schema`, the
  function chat templates take (an async def works the same way).
Every failure is a one-line ConfigError naming the spec and what to do.
"""
from __future__ import annotations

import dataclasses
import inspect

from spmdrl.errors import ConfigError
from spmdrl.tools.base import Tool
from spmdrl.process.usercode import load_object, one_line

KEY = "multi_turn.tools"


def builtin_factories() -> dict:
    """Built-in name -> factory(cfg) -> Tool."""
    from spmdrl.tools import builtin

    return {"calculator": builtin.calculator_tool, "python": builtin.python_tool, "http_exec": builtin.http_exec_tool}


def tool_from_function(fn, spec: str | None = None) -> Tool:
    """A Tool for a plain typed function, its schema from the signature and docstring."""
    from transformers.utils import get_json_schema

    where = f"tool {spec!r}" if spec else f"tool function {getattr(fn, '__name__', fn)!r}"
    try:
        schema = get_json_schema(fn)["function"]
    except Exception as e:
        raise ConfigError(
            f"{KEY}: {where}: cannot derive its JSON schema ({one_line(e)}); give every argument a type hint and "
            "a Google-style docstring with a description and an 'Args:' line per argument, or name a Tool"
        ) from e
    return Tool(name=schema["name"], description=schema.get("description", ""), parameters=schema["parameters"],
                fn=fn)


def _resolve(obj, spec: str, schema: bool = True) -> Tool:
    if isinstance(obj, Tool):
        return obj
    if not callable(obj):
        raise ConfigError(f"{KEY}: tool {spec!r} is a {type(obj).__name__}; name a Tool, a function returning one, "
                          "or a typed function")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        sig = None
    required = sig is not None and any(
        p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values())
    returns_text = sig is not None and sig.return_annotation in (str, "str")
    if sig is not None and not required and not returns_text and not inspect.iscoroutinefunction(obj):
        try:
            made = obj()
        except Exception as e:
            raise ConfigError(f"{KEY}: tool factory {spec!r} raised {type(e).__name__}: {one_line(e)}") from e
        if not isinstance(made, Tool):
            raise ConfigError(
                f"{KEY}: {spec!r} takes no arguments, so it is taken for a factory, but it returned "
                f"{type(made).__name__}, not a Tool; return a spmdrl.tools.base.Tool, or annotate a tool function "
                "of no arguments `-> str`"
            )
        return made
    if not schema:  # a tool worker needs the callable only (and no transformers import)
        return Tool(name=getattr(obj, "__name__", spec), description="", parameters={"type": "object"}, fn=obj)
    return tool_from_function(obj, spec)


def load_tool(spec: str, cfg=None, *, schema: bool = True) -> Tool:
    """One spec -> Tool, remembering the spec (Tool.spec). `cfg` is the [multi_turn] section (the built-ins'
    limits and service URL); schema=False (a tool worker): a plain function's schema is not derived."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{KEY}: {spec!r} is not a tool; give a built-in name ({', '.join(builtin_factories())}) "
                          "or 'path/to/file.py:function' / 'package.module:function'")
    builtins = builtin_factories()
    if spec in builtins:
        return dataclasses.replace(builtins[spec](cfg), spec=spec)
    if ":" not in spec:
        raise ConfigError(f"{KEY}: {spec!r} is not a built-in tool ({', '.join(builtins)}); name user tools as "
                          "'path/to/file.py:function' or 'package.module:function'")
    tool = _resolve(load_object(spec, what="tool", key=KEY, error=ConfigError), spec, schema)
    if not isinstance(tool.name, str) or not tool.name or not callable(tool.fn):
        raise ConfigError(f"{KEY}: tool {spec!r} needs a non-empty name and a callable fn")
    if not isinstance(tool.parameters, dict) or tool.parameters.get("type") != "object":
        raise ConfigError(f"{KEY}: tool {spec!r} ({tool.name}): parameters must be a JSON schema of type 'object', "
                          f"found {tool.parameters!r:.100}")
    return dataclasses.replace(tool, spec=spec)


def load_tools(specs: list[str], cfg=None) -> list[Tool]:
    """Every spec of multi_turn.tools, in order; names must be distinct."""
    tools: list[Tool] = []
    seen: dict[str, str] = {}
    for spec in specs:
        tool = load_tool(spec, cfg)
        if tool.name in seen:
            raise ConfigError(f"{KEY}: {spec!r} and {seen[tool.name]!r} both define a tool named {tool.name!r}; "
                              "tool names must be distinct, drop or rename one")
        seen[tool.name] = spec
        tools.append(tool)
    return tools
