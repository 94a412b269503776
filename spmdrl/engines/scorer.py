"""A forward-only sequence-classification model (a reward model) sharded like the training engine: FSDP2
over "dp", DTensor TP over "tp" when tp > 1. Its one head: the score logit at each row's last real token."""
from __future__ import annotations

import torch
import torch.nn as nn

from spmdrl.config.derived import resolve_dtype
from spmdrl.dist.meshes import RoleMesh
from spmdrl.errors import ConfigError

from .fsdp import tp_plan
from spmdrl.models.model import backbone_of


class _LastTokenScore(nn.Module):
    """Root module: backbone + score head at each row's last attended position, inside one FSDP root forward
    (so the root's embeddings, final norm and head are unsharded while they are used)."""

    def __init__(self, hf_model: nn.Module, head: nn.Module):
        super().__init__()
        self.hf = hf_model
        self.head = head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        B, L = input_ids.shape
        backbone = backbone_of(self.hf)
        position_ids = torch.arange(L, device=input_ids.device).expand(B, L)
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        # rightmost attended position, whatever the padding side: [B]
        last = (torch.arange(L, device=input_ids.device) * attention_mask).argmax(-1)
        h = hidden[torch.arange(B, device=hidden.device), last]  # [B, H]
        return self.head(h)[:, 0].float()


def _score_head(hf: nn.Module, model_path: str) -> nn.Module:
    for name in ("score", "classifier"):
        head = getattr(hf, name, None)
        if isinstance(head, nn.Linear):
            return head
    raise ConfigError(
        f"reward.model_path = {model_path!r}: {type(hf).__name__} has no linear 'score' head; "
        "use a sequence-classification model (e.g. *ForSequenceClassification with num_labels = 1)"
    )


class FSDPScoreEngine:
    """The ScoreEngine (engines/base.py) on FSDP2: scores [B] of padded token rows; every rank of the mesh calls
    `scores` the same number of times."""

    def __init__(self, model_path: str, mesh: RoleMesh, device: torch.device, *, trust_remote_code: bool = False,
                 dtype: str = "auto"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForSequenceClassification

        try:
            hf, info = AutoModelForSequenceClassification.from_pretrained(
                model_path, num_labels=1, trust_remote_code=trust_remote_code,
                dtype=getattr(torch, resolve_dtype(dtype, device.type == "cuda")),
                attn_implementation="sdpa", output_loading_info=True,
            )
        except (OSError, ValueError, RuntimeError) as e:
            raise ConfigError(
                f"reward.model_path = {model_path!r}: cannot load a sequence-classification model with one label "
                f"({e}); give an HF reward-model directory or hub id"
            ) from None
        head = _score_head(hf, model_path)
        head_names = {n for n, m in hf.named_modules() if m is head}
        missing = sorted(k for k in info.get("missing_keys", []) if k.split(".")[0] in head_names)
        if missing:
            raise ConfigError(
                f"reward.model_path = {model_path!r}: the checkpoint has no trained score head (missing {missing}); "
                "it is not a reward model, and a randomly initialised head would give meaningless rewards"
            )
        hf.config.use_cache = False
        hf.requires_grad_(False)
        hf.eval()
        if mesh.tp_size > 1:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(backbone_of(hf), mesh.submesh("tp"), tp_plan())
        cuda = device.type == "cuda"
        param_dtype = getattr(torch, resolve_dtype(dtype, cuda))
        mp = MixedPrecisionPolicy(param_dtype=param_dtype) if param_dtype != torch.float32 else MixedPrecisionPolicy()
        kw = dict(mesh=mesh.submesh("dp"), mp_policy=mp, reshard_after_forward=True)
        self.module = _LastTokenScore(hf, head)
        from spmdrl.models.model import decoder_blocks

        for block in decoder_blocks(backbone_of(hf)):
            fully_shard(block, **kw)
        fully_shard(self.module, **kw)
        self.module.to(device)
        self.module.eval()
        self.mesh = mesh
        self.vocab_size = hf.get_input_embeddings().num_embeddings

    @torch.no_grad()
    def scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.module(input_ids, attention_mask)
