"""Reward model: an HF sequence-classification LM (num_labels=1) scores each (prompt, response) on the reward
role's mesh, sharded like the training engine (FSDP2 over "dp", DTensor TP over "tp" when tp > 1).

The score of a sample is the head's logit at its last real token. When the reward model shares the policy's
tokenizer (same vocabulary and chat template) it reads the policy's token ids as they are; otherwise it
re-renders the conversation with its own chat template and re-tokenises the text. Combining with rule rewards
is the trainer's job: `combine_rewards`.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn

from spmdrl.dist.meshes import RoleMesh
from spmdrl.errors import ConfigError

log = logging.getLogger("spmdrl")


def combine_rewards(rule, rm, rule_weight: float, model_weight: float) -> torch.Tensor:
    """final = rule_weight * rule + model_weight * rm, per sample, float32. Either score may be None (absent)."""
    pairs = ((rule_weight, rule), (model_weight, rm))
    parts = [(w, torch.as_tensor(x, dtype=torch.float32)) for w, x in pairs if x is not None]
    if not parts:
        raise ValueError("combine_rewards needs a rule score or a reward-model score")
    shapes = {tuple(t.shape) for _, t in parts}
    if len(shapes) > 1:
        raise ValueError(f"rule and reward-model scores differ in shape: {sorted(shapes)}")
    return sum(float(w) * t for w, t in parts)


def same_tokenizer(a, b) -> bool:
    """Whether token ids of `a` mean the same to `b`: same vocabulary (with added tokens) and chat template."""
    if a is b:
        return True
    return a.get_vocab() == b.get_vocab() and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)


class _LastTokenScore(nn.Module):
    """Root module: backbone + score head at each row's last attended position, inside one FSDP root forward
    (so the root's embeddings, final norm and head are unsharded while they are used)."""

    def __init__(self, hf_model: nn.Module, head: nn.Module):
        super().__init__()
        self.hf = hf_model
        self.head = head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        B, L = input_ids.shape
        backbone = getattr(self.hf, self.hf.base_model_prefix)
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


class RewardModelScorer:
    """A sequence-classification reward model sharded over a role mesh.

    Every rank of the mesh must call `score` the same number of times (the forwards are FSDP collectives);
    ranks of one TP group must pass the same samples. Ranks of different DP groups may pass different numbers
    of samples: the shorter ones run empty forwards to keep the all-gathers matched.
    """

    def __init__(
        self,
        model_path: str,
        mesh: RoleMesh,
        device: torch.device,
        *,
        tokenizer_path: str = "",
        policy_tokenizer,
        micro_batch_size: int = 8,
        trust_remote_code: bool = False,
        dtype: str = "auto",
    ):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if micro_batch_size < 1:
            raise ConfigError(f"reward.model_micro_batch_size must be >= 1, found {micro_batch_size}")
        if not mesh.active:
            raise ValueError(f"rank {mesh.rank} is not in the reward role's ranks {list(mesh.layout.ranks)}")
        self.device, self.mesh, self.micro_batch_size = device, mesh, micro_batch_size
        tok_path = tokenizer_path or model_path
        key = "reward.model_tokenizer_path" if tokenizer_path else "reward.model_path"
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tok_path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{key} = {tok_path!r}: cannot load the tokenizer ({e}); give an HF directory or hub id"
            ) from None
        try:
            hf, info = AutoModelForSequenceClassification.from_pretrained(
                model_path, num_labels=1, trust_remote_code=trust_remote_code,
                dtype=torch.bfloat16 if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda") else torch.float32,
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

            from spmdrl.engines.fsdp import _tp_plan

            parallelize_module(getattr(hf, hf.base_model_prefix), mesh.submesh("tp"), _tp_plan())
        cuda = device.type == "cuda"
        param_dtype = torch.bfloat16 if dtype == "bfloat16" or (dtype == "auto" and cuda) else torch.float32
        mp = MixedPrecisionPolicy(param_dtype=param_dtype) if param_dtype != torch.float32 else MixedPrecisionPolicy()
        kw = dict(mesh=mesh.submesh("dp"), mp_policy=mp, reshard_after_forward=True)
        self.module = _LastTokenScore(hf, head)
        for block in getattr(getattr(hf, hf.base_model_prefix), "layers", []):
            fully_shard(block, **kw)
        fully_shard(self.module, **kw)
        self.module.to(device)
        self.module.eval()
        self.hf = hf
        tk = self.tokenizer
        self.pad_id = next((i for i in (tk.pad_token_id, tk.eos_token_id) if i is not None), 0)
        self.same_tokenizer = same_tokenizer(policy_tokenizer, tk)
        self.vocab_size = hf.get_input_embeddings().num_embeddings
        log.info(
            "reward model %s: %s tokens (%s), micro-batch %d",
            model_path, "policy" if self.same_tokenizer else "re-tokenised", type(tk).__name__, micro_batch_size,
        )

    # ---- inputs -------------------------------------------------------------------------------------
    def encode(self, batch_prompt_messages, response_text, prompt_ids, response_ids) -> list[list[int]]:
        """The reward model's token ids of each sample: the policy's ids when the tokenizers agree, else the
        conversation re-rendered with the reward model's chat template (plain concatenation without one)."""
        if self.same_tokenizer:
            ids = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
            # a policy whose embedding is padded past the tokenizer can sample ids this model lacks:
            # those samples are re-tokenised from their text
            bad = [i for i, x in enumerate(ids) if x and max(x) >= self.vocab_size]
            if bad:
                redo = self._encode_text([batch_prompt_messages[i] for i in bad], [response_text[i] for i in bad])
                for i, x in zip(bad, redo):
                    ids[i] = x
            return ids
        return self._encode_text(batch_prompt_messages, response_text)

    def _encode_text(self, batch_prompt_messages, response_text) -> list[list[int]]:
        tk = self.tokenizer
        if getattr(tk, "chat_template", None):
            texts = [
                tk.apply_chat_template(list(msgs) + [{"role": "assistant", "content": resp}], tokenize=False)
                for msgs, resp in zip(batch_prompt_messages, response_text)
            ]
            add_special = False  # the template writes its own special tokens
        else:
            texts = [
                "\n\n".join(str(m["content"]) for m in msgs) + resp
                for msgs, resp in zip(batch_prompt_messages, response_text)
            ]
            add_special = True
        return [list(ids) for ids in tk(texts, add_special_tokens=add_special)["input_ids"]]

    def _pad(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
        return ids.to(self.device), mask.to(self.device)

    def _max_over_mesh(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        for dim, size in (("dp", self.mesh.dp_size), ("tp", self.mesh.tp_size)):
            if size > 1:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.mesh.group(dim))
        return int(t.item())

    # ---- scoring ------------------------------------------------------------------------------------
    @torch.no_grad()
    def score_ids(self, seqs: list[list[int]]) -> torch.Tensor:
        """Scores [B] float32 (CPU) of token sequences in the reward model's vocabulary, micro-batched by length."""
        if any(len(s) == 0 for s in seqs):
            raise ValueError("reward model: an empty token sequence has no last token to score")
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]), reverse=True)  # similar lengths share a pad
        chunks = [order[i: i + self.micro_batch_size] for i in range(0, len(order), self.micro_batch_size)]
        n_forwards = self._max_over_mesh(len(chunks))
        out = torch.zeros(len(seqs), dtype=torch.float32)
        for k in range(n_forwards):
            if k < len(chunks):
                ids, mask = self._pad([seqs[i] for i in chunks[k]])
                out[chunks[k]] = self.module(ids, mask).cpu()
            else:  # this rank ran out of samples; match the other ranks' all-gathers
                self.module(*self._pad([[self.pad_id]]))
        return out

    def score(
        self,
        batch_prompt_messages: list[list[dict]],
        response_text: list[str],
        prompt_ids: list[list[int]],
        response_ids: list[list[int]],
    ) -> torch.Tensor:
        """Reward-model score of each sample, float32 [B] on CPU.

        batch_prompt_messages: each sample's prompt as chat messages; response_text: decoded responses (used
        when re-tokenising); prompt_ids / response_ids: the policy's tokens (used when the tokenizers agree).
        """
        n = len(response_text)
        if not (len(batch_prompt_messages) == len(prompt_ids) == len(response_ids) == n):
            raise ValueError(
                f"reward model: batch fields differ in length (messages {len(batch_prompt_messages)}, "
                f"response_text {n}, prompt_ids {len(prompt_ids)}, response_ids {len(response_ids)})"
            )
        return self.score_ids(self.encode(batch_prompt_messages, response_text, prompt_ids, response_ids))
