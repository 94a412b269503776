"""vLLM in this process leaves transformers' model classes as they were.

vLLM serves some architectures through its Transformers modeling backend, which builds the model from
transformers' own classes and applies its compile decorator to the decoder class *in place*
(`vllm/model_executor/models/transformers/base.py`, `support_torch_compile(...)(cls)`;
`vllm/compilation/decorators.py`): it appends a base class and replaces `__init__` and `__call__`. The trainer
builds its model from the same class in the same process, so without care

  * a model built before the engine crashes at its next forward (`__call__` reads `do_not_compile`, an
    attribute only the new `__init__` sets), and
  * a model built after the engine runs vLLM's `__init__`, which looks up a vLLM config and may compile it.

`transformers_classes_kept()` wraps every in-process vLLM build (the rollout engine, the sync's loader probe):
it records every transformers model class loaded before the build (the served architecture's modeling module is
imported first), and afterwards puts each class vLLM changed back exactly as it was; vLLM's own instances get a
private copy of the class carrying vLLM's changes (`KeptClasses.adopt`, with the engine's model). The trainer's
models, built before or after, never see vLLM's decorator; vLLM's keep it.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch.nn as nn

log = logging.getLogger("spmdrl")

_SKIP = ("__dict__", "__weakref__")
VLLM_INSTANCE_MARK = "do_not_compile"  # set on each instance by vLLM's decorated __init__, never by transformers


def _model_classes() -> list[type]:
    """Every nn.Module class defined in a loaded transformers modeling module."""
    out = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("transformers.models."):
            continue
        for v in list(vars(mod).values()):
            if isinstance(v, type) and issubclass(v, nn.Module) and v.__module__ == name:
                out.append(v)
    return out


def import_modeling(hf_config) -> None:
    """Import the transformers modeling module of `hf_config`'s architecture (and its text model's), so its
    classes are on record before vLLM can change them; a config transformers does not know is left alone."""
    from transformers import AutoModel, AutoModelForCausalLM

    configs = [hf_config]
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    if text is not hf_config:
        configs.append(text)
    for c in configs:
        for auto in (AutoModelForCausalLM, AutoModel):
            try:
                auto._model_mapping[type(c)]
            except (KeyError, ValueError, ImportError, AttributeError):
                continue


def _vllm_decorated(cls: type) -> bool:
    """Whether vLLM's decorator is on `cls`: a vLLM base class added, or a method of vLLM's in its own dict."""
    return (any(b.__module__.startswith("vllm.") for b in cls.__bases__)
            or any(getattr(v, "__module__", None) and v.__module__.startswith("vllm.") for v in vars(cls).values()
                   if callable(v)))


class KeptClasses:
    """What transformers_classes_kept did: copies[cls] is the private class carrying vLLM's changes to cls."""

    def __init__(self):
        self.copies: dict[type, type] = {}

    def adopt(self, root: nn.Module) -> int:
        """Give each module of vLLM's model `root` that vLLM's decorator built (it marks them) the private copy of
        its class; returns how many. Called with the engine's model right after the build."""
        n = 0
        for m in root.modules():
            copy = self.copies.get(type(m))
            if copy is not None and VLLM_INSTANCE_MARK in vars(m):
                m.__class__ = copy
                n += 1
        return n


@contextmanager
def transformers_classes_kept(hf_config=None) -> Iterator[KeptClasses]:
    """Within: build a vLLM model in this process. After: every transformers model class it changed is as before,
    and `kept.copies` holds a private copy of each carrying vLLM's changes, which `kept.adopt(vllm_model)` gives
    to the instances vLLM built."""
    kept = KeptClasses()
    if hf_config is not None:
        import_modeling(hf_config)
    before = {cls: (cls.__bases__, dict(vars(cls))) for cls in _model_classes()}
    try:
        yield kept
    finally:
        changed = [cls for cls in before if _vllm_decorated(cls) and not _was_decorated(before[cls])]
        unrecorded = [cls for cls in _model_classes() if cls not in before and _vllm_decorated(cls)]
        kept.copies = _put_back(changed, before)
        for cls in unrecorded:  # imported during the build: no record of its own methods to put back
            log.warning("vLLM changed transformers' %s.%s, imported while the engine was built; a trainer model of "
                        "that class built in this process would run vLLM's compile wrapper", cls.__module__,
                        cls.__qualname__)


def _was_decorated(record: tuple) -> bool:
    bases, attrs = record
    return any(b.__module__.startswith("vllm.") for b in bases)


def _put_back(changed: list[type], before: dict) -> dict[type, type]:
    """Restore each class of `changed` to its record; returns {class: private copy with vLLM's changes}."""
    copies = {}
    for cls in changed:
        attrs = {k: v for k, v in vars(cls).items() if k not in _SKIP}
        copies[cls] = type(cls)(cls.__name__, cls.__bases__, attrs)
        bases, attrs = before[cls]
        if cls.__bases__ != bases:
            cls.__bases__ = bases
        for k in [k for k in vars(cls) if k not in attrs and k not in _SKIP]:
            delattr(cls, k)
        for k, v in attrs.items():
            if k not in _SKIP and vars(cls).get(k) is not v:
                setattr(cls, k, v)
    if changed:
        log.debug("vLLM's compile decorator kept off transformers' %s", ", ".join(c.__name__ for c in changed))
    return copies
