"""Causal attention kernels of the training engines: packed variable-length sequences and right-padded rows,
grouped-query attention handled by the kernels themselves (key/value heads are never repeated).

    varlen_attention(q, k, v, cu_seqlens, max_seqlen)   # q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]
    padded_causal_attention(q, k, v)                    # q [B, Hq, L, D], k/v [B, Hkv, L, D] -> [B, Hq, L, D]

Packed layout: the tokens of n sequences one after another, sequence i at [cu_seqlens[i], cu_seqlens[i + 1]);
a token attends to the earlier tokens of its own sequence and itself, exactly as if the sequence ran alone.
On CPU the sequences go through torch's scaled_dot_product_attention with is_causal (no mask tensor
anywhere): in one call with each sequence at the start of its own row when their lengths are similar (the rows'
attention costs at most twice the sequences' own), else one call per sequence. On CUDA the whole batch is one call of torch's flash varlen kernel
(torch.nn.attention.varlen.varlen_attn), else flash-attn's flash_attn_varlen_func when it is installed, else
the per-sequence loop.

Right-padded rows (each sequence from column 0, padding after it) need no mask either: under causal attention a
real token only sees earlier positions, all of them real. Padding positions get outputs nobody reads.

`register_hf()` makes these the attention of a transformers model built with
attn_implementation=HF_IMPLEMENTATION: the model then calls `hf_attention`, which takes the packed boundaries
from the cu_seq_lens_q / max_length_q keyword arguments the backbone forward passes through to every layer.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

HF_IMPLEMENTATION = "spmdrl_varlen"


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     *, scale: float | None = None, lengths: list[int] | None = None,
                     window: int | None = None) -> torch.Tensor:
    """Causal attention over packed sequences: q [T, Hq, D], k and v [T, Hkv, D] with Hq a multiple of Hkv
    (query head h uses key/value head h // (Hq / Hkv)); cu_seqlens int32 [n + 1], 0 first and T last;
    max_seqlen the longest sequence. Returns [T, Hq, D]. scale: default 1 / sqrt(D). lengths: the sequence
    lengths as host integers when the caller has them (the per-sequence loop then reads nothing back from
    cu_seqlens). window: sliding-window attention, a token at position i sees positions j of its sequence with
    i - window < j <= i (transformers' convention); it runs SDPA with a banded mask (the CPU forms, on any
    device: no fused varlen call takes the window here)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"varlen_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if q.is_cuda and window is None:
        out = _varlen_cuda(q, k, v, cu_seqlens, max_seqlen, scale)
        if out is not None:
            return out
    lengths = lengths if lengths is not None else cu_seqlens.diff().tolist()
    if len(lengths) * max(lengths, default=0) ** 2 <= 2 * sum(n * n for n in lengths):
        return _varlen_batched(q, k, v, cu_seqlens, lengths, scale, window)
    return _varlen_loop(q, k, v, cu_seqlens, scale, lengths, window)


def window_mask(n: int, window: int, device) -> torch.Tensor:
    """[n, n] boolean: query i attends key j when i - window < j <= i."""
    i = torch.arange(n, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


def _sdpa_causal(q, k, v, scale, window, gqa):
    """SDPA over [.., H, L, D]: is_causal (flash kernels may run), or with a window the banded mask."""
    if window is None or window >= q.shape[-2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(q.shape[-2], window, q.device), scale=scale,
                                          enable_gqa=gqa)


def _varlen_batched(q, k, v, cu_seqlens, lengths, scale, window=None):
    """All sequences in one causal SDPA call, each placed at the start of its own row of max(lengths) positions
    (attention only: the caller's linear layers still run on the packed tokens). Exact: under causal attention
    a token sees only earlier positions of its row, all of its own sequence. Chosen when the rows' attention
    costs at most twice the sequences' own (similar lengths): one call instead of one per sequence."""
    from spmdrl.engines.packing import seq_ids

    n, width = len(lengths), max(lengths)
    cu = cu_seqlens.to(q.device).long()
    seq = seq_ids(cu)  # the sequence of each packed token, and its column in that sequence's row
    col = torch.arange(q.shape[0], device=q.device) - cu[seq]

    def rows(x):  # [T, H, D] -> [n, H, width, D]
        return x.new_zeros(n, width, *x.shape[1:]).index_put((seq, col), x).transpose(1, 2)

    out = _sdpa_causal(rows(q), rows(k), rows(v), scale, window, q.shape[1] != k.shape[1])
    return out.transpose(1, 2)[seq, col]


def _varlen_loop(q, k, v, cu_seqlens, scale, lengths=None, window=None):
    """One SDPA call per sequence, each on its own slice (the CPU path for lengths that differ a lot, and the
    CUDA fallback)."""
    lengths = lengths if lengths is not None else cu_seqlens.diff().tolist()
    gqa = q.shape[1] != k.shape[1]
    outs = []
    # split, not one slice per sequence: its backward is one concatenation, not a zero-filled [T, H, D] each
    for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
        # [n, H, D] -> [1, H, n, D] (4-D: CPU SDPA's flash kernel; enable_gqa groups the heads)
        o = _sdpa_causal(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], scale, window,
                         gqa)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs) if outs else q.new_empty(q.shape)


def _varlen_cuda(q, k, v, cu_seqlens, max_seqlen, scale):  # pragma: no cover - CUDA only
    """One fused call on a GPU, or None when no kernel here takes these inputs (then the caller runs SDPA).

    torch's varlen_attn changed its keywords across releases; each form is called with what it accepts:
      first release   (..., max_q, max_k, is_causal=False, return_aux=None): no scale, no GQA flag;
      later           (..., *, return_aux, scale, window_size, ...): causal as window_size (-1, 0);
      torch 2.13      the same plus enable_gqa, which it requires when key/value have fewer heads.
    Without a scale keyword, a scale other than the default 1/sqrt(D) is folded into q (q * scale * sqrt(D)).
    Without enable_gqa, grouped heads go to the kernel as they are (torch's flash forward takes Hq a multiple
    of Hkv). The flash kernels take float16/bfloat16 only: other dtypes (model.dtype = float32) return None."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return None
    gqa = q.shape[1] != k.shape[1]
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    if varlen_attn is not None:
        params = inspect.signature(varlen_attn).parameters
        kw = {}
        if "window_size" in params:
            kw["window_size"] = (-1, 0)  # causal
        elif "is_causal" in params:
            kw["is_causal"] = True
        else:
            kw = None
        if kw is not None and gqa and "enable_gqa" in params:
            kw["enable_gqa"] = True
        if kw is not None:
            qs = q
            if scale is not None and "scale" in params:
                kw["scale"] = scale
            elif scale is not None and abs(scale * q.shape[-1] ** 0.5 - 1.0) > 1e-6:
                qs = q * (scale * q.shape[-1] ** 0.5)  # the kernel's default 1/sqrt(D) then gives `scale`
            return varlen_attn(qs, k, v, cu, cu, max_seqlen, max_seqlen, **kw)
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=True)


def padded_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                            dropout_p: float = 0.0, window: int | None = None) -> torch.Tensor:
    """Causal attention over right-padded rows: q [B, Hq, L, D], k and v [B, Hkv, L, D] -> [B, Hq, L, D].
    SDPA with is_causal and no mask, so it may take its flash kernels; GQA by SDPA's enable_gqa. window: a
    sliding window (varlen_attention's convention), by a banded mask."""
    if window is not None and window < q.shape[-2]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(q.shape[-2], window, q.device),
                                              scale=scale, dropout_p=dropout_p, enable_gqa=q.shape[1] != k.shape[1])
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p,
                                          enable_gqa=q.shape[1] != k.shape[1])


def hf_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                 dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                 cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None, sp=None, **kwargs):
    """transformers' attention-function interface: query [B, Hq, L, D], key/value [B, Hkv, L, D] (the heads of
    this tensor-parallel rank) -> ([B, L, Hq, D], None).

    sp (a SequenceShard, engines/sequence_parallel.py): L is this rank's part of the tokens; the heads are
    exchanged for the tokens of the sp group (all-to-all), attention runs as below over the whole width with the
    shard's full-row boundaries, and the output goes back to the local tokens.

    cu_seq_lens_q given: one row of packed sequences (B = 1), varlen_attention. A 4-D attention_mask given (a
    caller's explicit mask): SDPA with that mask. Neither: right-padded rows, padded_causal_attention.
    sliding_window (a windowed layer, e.g. Gemma 3's local layers): the window applies in every form but the
    caller's explicit mask, which already holds it."""
    if sp is not None:
        q = sp.heads_to_tokens(query)
        k, v = (sp.heads_to_tokens(sp.spread_kv(t, query.shape[1])) for t in (key, value))
        packed = {} if sp.cu_seqlens is None else dict(cu_seq_lens_q=sp.cu_seqlens, max_length_q=sp.max_seqlen)
        out, _ = hf_attention(module, q, k, v, attention_mask, dropout, scaling, sliding_window, **packed, **kwargs)
        return sp.tokens_to_heads(out), None
    if kwargs.get("softcap") is not None:
        raise ValueError(f"attention implementation {HF_IMPLEMENTATION!r} has no attention-logit soft-capping: "
                         "set model.attn_implementation = 'sdpa'")
    if cu_seq_lens_q is not None:
        if query.shape[0] != 1:
            raise ValueError(f"packed sequences come as one row, got {query.shape[0]}")
        if dropout:
            raise ValueError("varlen attention runs no attention dropout: set the model's attention_dropout to 0")
        out = varlen_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                               cu_seq_lens_q, int(max_length_q), scale=scaling, window=sliding_window)
        return out[None], None
    if attention_mask is not None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             dropout_p=dropout, enable_gqa=query.shape[1] != key.shape[1])
    else:
        out = padded_causal_attention(query, key, value, scale=scaling, dropout_p=dropout, window=sliding_window)
    return out.transpose(1, 2).contiguous(), None


def register_hf() -> str:
    """Register hf_attention with transformers under HF_IMPLEMENTATION (idempotent); returns the name.

    It is not registered with transformers' mask interface on purpose: for an implementation outside it the
    backbone builds no mask at all (and does not scan the position ids for packed sequences, which costs a
    host sync per forward); a 4-D mask a caller passes still reaches hf_attention as it is."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_IMPLEMENTATION, hf_attention)
    return HF_IMPLEMENTATION
