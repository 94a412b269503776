"""A tiny Qwen2 model and character-level tokenizer, built locally.

No model hub is reachable from CI or the CPU quickstart, so tests and the quickstart build their own model.
It is a real `Qwen2ForCausalLM` saved in HF format, so the same `from_pretrained` path (transformers and
vLLM) loads it as it would load Qwen2.5-7B. Head dim is 32: vLLM's CPU attention needs >= 32.
"""
from __future__ import annotations

import os
import string

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out_dir: str | None = None):
    """Character-level tokenizer: one token per printable ASCII character, plus chat special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    hf.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        hf.save_pretrained(out_dir)
    return hf


def build_model(
    out_dir: str | None = None,
    *,
    vocab_size: int = 128,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
):
    """A randomly initialised Qwen2ForCausalLM (about 1M parameters with the defaults), float32."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        torch_dtype="float32",
        bos_token_id=0,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=0,
        use_sliding_window=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg).float()
    if out_dir is not None:
        model.save_pretrained(out_dir, safe_serialization=True)
    return model


def build_tiny(out_dir: str, *, seed: int = 0, **model_kwargs) -> str:
    """Write a tiny model + tokenizer into `out_dir` (an HF model directory) and return the path."""
    os.makedirs(out_dir, exist_ok=True)
    tok = build_tokenizer(out_dir)
    model_kwargs.setdefault("vocab_size", max(128, len(tok)))
    build_model(out_dir, seed=seed, **model_kwargs)
    return out_dir
