"""A plain torch module + optimizer (+ scheduler) behind the checkpoint half of the engine protocol
(spmdrl/engines/base.py): what checkpoint unit tests save and load without building an FSDP2 model."""
import contextlib
import types

from spmdrl.checkpoint.dcp import load_module_state, module_state, param_spec


class ModuleEngine(types.SimpleNamespace):
    trainable = True
    lora = None

    def checkpoint_access(self):
        return contextlib.nullcontext()

    def checkpoint_state(self):
        return module_state(self.module, self.optimizer, getattr(self, "scheduler", None))

    def load_checkpoint_state(self, tensors, meta):
        load_module_state(self.module, self.optimizer, getattr(self, "scheduler", None), tensors, meta)

    def param_manifest(self):
        return param_spec(self.module)

    def hf_prefix(self):
        return ""
