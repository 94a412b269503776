"""Tiny models (Qwen2 by default, or any architecture of ARCHS) and a byte-level tokenizer, built locally.

No model hub is reachable from CI or the CPU quickstart, so tests and the quickstart build their own model.
It is a real `Qwen2ForCausalLM` saved in HF format, so the same `from_pretrained` path (transformers and
vLLM) loads it as it would load Qwen2.5-7B. Head dim is 32: vLLM's CPU attention needs >= 32.
"""
from __future__ import annotations

import os

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    # with tools: a short system turn naming them (the tiny model reads bytes; full JSON schemas would cost
    # hundreds of tokens per prompt); tool results are turns of role "tool"
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] if 'function' in t "
    "else t['name'] }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out_dir: str | None = None):
    """Byte-level BPE tokenizer with no merges: one token per byte (the 256 byte symbols of GPT-2/Qwen's
    byte-level alphabet), plus the chat special tokens. Byte-level like Qwen's, so transformers' Qwen2Tokenizer
    (which AutoTokenizer picks for a qwen2 model directory) loads it with identical behaviour."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    hf.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        hf.save_pretrained(out_dir)
    return hf


# Per architecture: the HF model_type and what a tiny instance sets beyond the common sizes. Head dim is 32
# everywhere (vLLM's CPU attention needs >= 32); sliding windows are off except Gemma 3's, whose alternating
# sliding/full layers are part of the family (a window of 16 tokens, shorter than the quickstart's sequences).
ARCHS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {"use_sliding_window": False}),
    "qwen3": ("qwen3", {"use_sliding_window": False}),
    "mistral": ("mistral", {"sliding_window": None}),
    "gemma3": ("gemma3_text", {"sliding_window": 16, "query_pre_attn_scalar": 32, "layer_types": "alternate"}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None,
                            "router_jitter_noise": 0.0}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                                "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
                                "norm_topk_prob": True}),
    # Qwen2-MoE: routed experts plus one shared expert MLP on every token, scaled by sigmoid(shared_expert_gate(x));
    # top-k weights not renormalised, as in the released Qwen1.5-MoE / Qwen2-57B-A14B; every layer sparse
    "qwen2_moe": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                                "shared_expert_intermediate_size": 256, "decoder_sparse_step": 1,
                                "mlp_only_layers": [], "use_sliding_window": False, "norm_topk_prob": False}),
    "phi3": ("phi3", {"sliding_window": None}),  # fused qkv_proj and gate_up_proj in the checkpoint
    # Falcon (new decoder architecture, rotary, grouped kv heads): vLLM's loader regroups the fused q/k/v heads by
    # copies, so those tensors take the sync's whole-tensor route
    "falcon": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2, "alibi": False, "bias": False,
                          "parallel_attn": True, "ffn_hidden_size": None}),
}


def build_model(
    out_dir: str | None = None,
    *,
    arch: str = "qwen2",
    vocab_size: int = 320,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
):
    """A randomly initialised causal LM of architecture `arch` (a key of ARCHS; about 1M parameters with the
    defaults), float32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    model_type, extra = ARCHS[arch]
    extra = dict(extra)
    if model_type == "falcon":  # its own name for the kv heads; vLLM's Falcon assumes an MLP of 4 x hidden
        extra["num_kv_heads"], extra["ffn_hidden_size"] = num_kv_heads, 4 * hidden_size
    if extra.get("layer_types") == "alternate":
        extra["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        **({} if model_type == "falcon" else {"head_dim": hidden_size // num_heads}),  # Falcon derives it
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        torch_dtype="float32",
        bos_token_id=0,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=0,
        **extra,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg).float()
    if out_dir is not None:
        model.save_pretrained(out_dir, safe_serialization=True)
    return model


def build_tiny(out_dir: str, *, seed: int = 0, **model_kwargs) -> str:
    """Write a tiny model + tokenizer into `out_dir` (an HF model directory) and return the path."""
    os.makedirs(out_dir, exist_ok=True)
    tok = build_tokenizer(out_dir)
    model_kwargs.setdefault("vocab_size", max(320, len(tok)))
    build_model(out_dir, seed=seed, **model_kwargs)
    return out_dir


def build_reward_model(out_dir: str, *, seed: int = 0, tokenizer=None, **sizes) -> str:
    """Write a tiny Qwen2ForSequenceClassification reward model (one label) + tokenizer into `out_dir`.

    `tokenizer` defaults to the byte-level one of `build_tokenizer`; its pad token becomes the model's
    pad_token_id. `sizes` are `build_model`'s size keywords. Returns the path.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    os.makedirs(out_dir, exist_ok=True)
    tok = tokenizer if tokenizer is not None else build_tokenizer()
    tok.save_pretrained(out_dir)
    s = dict(
        vocab_size=max(320, len(tok)), hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
        intermediate_size=384, max_position_embeddings=512, tie_word_embeddings=False,
    )
    unknown = set(sizes) - set(s)
    if unknown:
        raise TypeError(f"build_reward_model: unknown size keywords {sorted(unknown)}; known: {sorted(s)}")
    s.update(sizes)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    cfg = Qwen2Config(
        vocab_size=s["vocab_size"],
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_heads"],
        num_key_value_heads=s["num_kv_heads"],
        max_position_embeddings=s["max_position_embeddings"],
        tie_word_embeddings=s["tie_word_embeddings"],
        torch_dtype="float32",
        bos_token_id=pad,
        eos_token_id=tok.eos_token_id if tok.eos_token_id is not None else pad,
        pad_token_id=pad,
        num_labels=1,
        use_sliding_window=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(cfg).float()
        # scores of order one, so tests can tell samples apart (the default init gives ~0.01)
        torch.nn.init.normal_(model.score.weight, std=s["hidden_size"] ** -0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


# ---- any architecture: a published config's defaults scaled down --------------------------------------------

# Standard size keys (transformers' attribute_map translates them for families that name them otherwise: n_embd,
# n_head, ...). Head dim 32 (vLLM's CPU attention needs >= 32).
TINY_SIZES = dict(vocab_size=320, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=256, max_position_embeddings=512)
TINY_EXPERTS = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_k=2,
                    moe_topk=2, moe_intermediate_size=64, shared_expert_intermediate_size=64, n_group=1, topk_group=1,
                    first_k_dense_replace=0, num_dense_layers=0, expert_layer_offset=0, decoder_sparse_step=1)
# multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4.7-Flash): ranks and head dims scaled together
TINY_MLA = dict(q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32)
TINY_LAYERS = 2


def _scaled_layer_list(value: list, n: int) -> list:
    """A per-layer list (layer_types, mlp_layer_types, ...) for n layers: its first n entries, with every kind it
    names kept (the last entry replaced by a missing kind) so a tiny model still has each kind of layer."""
    head = list(value[:n])
    for kind in dict.fromkeys(value):
        if kind not in head and n > 0:
            head[-1] = kind
    return head


def tiny_config(model_type: str, *, layers: int = TINY_LAYERS):
    """The config of a tiny random instance of `model_type` (any architecture transformers knows): its
    defaults (a published model's sizes) with sizes, experts, latent-attention ranks and per-layer lists scaled
    down, token ids inside the tiny vocabulary, float32. Raises ValueError for a model type transformers lacks."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n_layers = layers
    for key in ("num_hidden_layers", "n_layers", "num_layers"):
        if hasattr(text, key):
            setattr(text, key, n_layers)
    def put(key, value):
        try:
            setattr(text, key, value)
        except (AttributeError, TypeError):  # a derived property (Falcon's head_dim), or a per-layer one
            pass

    for key, value in TINY_SIZES.items():
        if key in vars(text) or key in getattr(text, "attribute_map", {}):
            put(key, value)
    for table in (TINY_EXPERTS, TINY_MLA):
        for key, value in table.items():
            if vars(text).get(key) is not None:
                put(key, value)
    if vars(text).get("kv_lora_rank"):  # latent attention: every head has its own key and value
        put("num_key_value_heads", TINY_SIZES["num_attention_heads"])
    for period, offset in (("attn_layer_period", "attn_layer_offset"), ("expert_layer_period", "expert_layer_offset")):
        if vars(text).get(period):  # Jamba: one attention / expert layer per period
            put(period, n_layers)
            put(offset, n_layers - 1)
    if getattr(text, "qk_head_dim", None) is not None and getattr(text, "qk_rope_head_dim", None):
        text.qk_head_dim = text.qk_nope_head_dim + text.qk_rope_head_dim
    if hasattr(text, "rotary_dim") and text.rotary_dim:  # GPT-J, CodeGen: rotary on part of each head
        text.rotary_dim = min(text.rotary_dim, TINY_SIZES["head_dim"])
    for key, value in list(vars(text).items()):
        if isinstance(value, list) and len(value) > n_layers and key.endswith(("layer_types", "layers_block_type")):
            setattr(text, key, _scaled_layer_list(value, n_layers))
    for key in ("no_rope_layers",):
        if isinstance(getattr(text, key, None), list):
            setattr(text, key, getattr(text, key)[:n_layers])
    if isinstance(getattr(text, "mlp_only_layers", None), list):
        text.mlp_only_layers = []
    eos = SPECIAL_TOKENS.index("<|im_end|>")
    for c in {id(x): x for x in (cfg, text)}.values():
        c.pad_token_id, c.bos_token_id, c.eos_token_id = 0, 0, eos
        c.torch_dtype = "float32"
    return cfg


def build_any(out_dir: str, model_type: str, *, seed: int = 0, layers: int = TINY_LAYERS) -> str:
    """Write a tiny random `model_type` (tiny_config) with the byte-level tokenizer into out_dir; returns it.
    A vision-language type of VLM_ARCHS goes to build_vlm. Raises whatever transformers raises when the scaled
    config cannot be built."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type in VLM_ARCHS:
        return build_vlm(out_dir, model_type, seed=seed, layers=layers)
    cfg = tiny_config(model_type, layers=layers)
    os.makedirs(out_dir, exist_ok=True)
    build_tokenizer(out_dir)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg).float()
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoConfig.from_pretrained(out_dir)  # the saved config.json must load again (not every scaled config does)
    return out_dir


# ---- vision-language: Qwen2.5-VL / Qwen3-VL ---------------------------------------------------------------------

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
# the tiny chat template for messages whose content is a string or a list of {"type": "image"} / {"type": "text"}
# parts, rendering an image as Qwen-VL's chat templates do: <|vision_start|><|image_pad|><|vision_end|>
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# per family: the rotary sections of the 3-D (temporal, height, width) positions (their sum is head_dim / 2 = 16)
# and what the vision tower sets beyond its sizes
VLM_ARCHS = {
    "qwen2_5_vl": ({"mrope_section": [4, 6, 6]}, {"patch_size": 14, "fullatt_block_indexes": [1], "window_size": 56}),
    "qwen3_vl": ({"mrope_section": [6, 5, 5], "mrope_interleaved": True},
                 {"patch_size": 16, "deepstack_visual_indexes": [0], "num_position_embeddings": 64}),
}


def build_vlm_tokenizer(out_dir: str | None = None):
    """build_tokenizer's byte-level tokenizer (same ids for text) with Qwen-VL's vision tokens after the bytes and a
    chat template that renders image parts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + alphabet + VISION_TOKENS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=SPECIAL_TOKENS[1:] + VISION_TOKENS)
    hf.chat_template = VLM_CHAT_TEMPLATE
    if out_dir is not None:
        hf.save_pretrained(out_dir)
    return hf


def build_vlm(out_dir: str, arch: str = "qwen2_5_vl", *, seed: int = 0, layers: int = TINY_LAYERS) -> str:
    """Write a tiny random Qwen2.5-VL or Qwen3-VL (its language model as tiny_config's, a 2-block vision tower of
    width 64, patches merged 2 x 2 into one image token) with build_vlm_tokenizer and Qwen2-VL's image processor
    (images resized to between 1 and 16 image tokens) into out_dir; returns it."""
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if arch not in VLM_ARCHS:
        raise ValueError(f"unknown tiny vision-language architecture {arch!r}; choose one of {', '.join(VLM_ARCHS)}")
    rope, vision = VLM_ARCHS[arch]
    os.makedirs(out_dir, exist_ok=True)
    tok = build_vlm_tokenizer(out_dir)
    cfg = tiny_config(arch, layers=layers)
    text = cfg.text_config
    text.rope_parameters = {**text.rope_parameters, **rope}
    v = cfg.vision_config
    v.depth, v.hidden_size, v.num_heads, v.intermediate_size, v.out_hidden_size = 2, 64, 2, 128, text.hidden_size
    for key, value in vision.items():
        setattr(v, key, value)
    ids = tok.convert_tokens_to_ids(VISION_TOKENS)
    cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id = ids
    cfg.video_token_id = len(tok)  # no video here: an id inside the vocabulary that no text token has
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(cfg).float()
    model.save_pretrained(out_dir, safe_serialization=True)
    side = v.patch_size * 2  # one image token per side x side pixels
    Qwen2VLImageProcessorPil(patch_size=v.patch_size, temporal_patch_size=2, merge_size=2, min_pixels=side * side,
                             max_pixels=16 * side * side).save_pretrained(out_dir)
    return out_dir
