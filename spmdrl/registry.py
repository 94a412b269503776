"""Name -> function registries. The trainer looks algorithms up by name; it never branches on them."""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

from spmdrl.errors import ConfigError

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    def __init__(self, kind: str):
        self.kind = kind
        self._fns: dict[str, F] = {}

    def register(self, *names: str, **meta) -> Callable[[F], F]:
        """Register the decorated function under `names`. meta: what the trainer must know about it, declared
        here and set on the function as attributes (an estimator's `requires`, a sequence-level loss's
        `agg_mode`, a loss's `default_agg_mode`)."""

        def deco(fn: F) -> F:
            for key, value in meta.items():
                setattr(fn, key, value)
            for name in names:
                if name in self._fns:
                    raise ValueError(f"{self.kind} {name!r} registered twice")
                self._fns[name] = fn
            return fn

        return deco

    def get(self, name: str) -> F:
        try:
            return self._fns[name]
        except KeyError:
            raise ConfigError(
                f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self._fns))}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: str) -> bool:
        return name in self._fns
