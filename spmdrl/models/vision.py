"""Vision-language models (Qwen2.5-VL, Qwen3-VL): which families, and the forward's image-token arguments that the
training engine and the transformers rollout engine share."""
from __future__ import annotations

import contextlib
import os
import shutil

import torch

VISION_LANGUAGE = ("qwen2_5_vl", "qwen3_vl")  # the vision-language families spmdrl trains (docs/vlm.md)
VISION_TOWER_PREFIX = "model.visual."  # the vision tower's parameters (with its merger), by transformers' names


def in_vision_tower(name: str) -> bool:
    """Whether the HF parameter `name` (transformers' module names, as the training engines yield them) belongs to a
    vision-language model's vision tower."""
    return name.startswith(VISION_TOWER_PREFIX)


def is_vision_language(config) -> bool:
    """Whether `config` is one of the vision-language models spmdrl trains (a language model with a vision tower
    whose image tokens go into its prompt)."""
    return getattr(config, "model_type", None) in VISION_LANGUAGE


IMAGE_PROCESSOR_FILES = ("preprocessor_config.json",)  # what data/images.VisionPrompts loads besides the tokenizer


def copy_image_processor(src_dir: str, out_dir: str) -> None:
    """Copy a model directory's image processor config into an exported model directory (the tokenizer and the
    model config are saved by their own classes); nothing for a text model or a hub id."""
    for name in IMAGE_PROCESSOR_FILES:
        src = os.path.join(src_dir, name)
        if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(os.path.join(out_dir, name)):
            shutil.copyfile(src, os.path.join(out_dir, name))


def token_types(input_ids: torch.Tensor, image_token_id: int, prompt_len: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' mm_token_type_ids of Qwen-VL models: 1 on the prompt's image tokens, 0 elsewhere (its 3-D
    rotary positions are computed from them). prompt_len [B]: where each row's prompt ends (a response may hold the
    image token id as a sampled token, which is text); None: the whole row is prompt."""
    image = input_ids == image_token_id
    if prompt_len is not None:
        image &= torch.arange(input_ids.shape[-1], device=input_ids.device)[None] < prompt_len[:, None]
    return image.long()


@contextlib.contextmanager
def prompt_images_only(backbone, types: torch.Tensor):
    """Within: a Qwen-VL backbone places image features at the image tokens `types` marks (token_types), not at
    every token whose id is the image token's (a sampled response token may be one: transformers would count it
    as a placeholder and refuse the images)."""
    own = backbone.get_placeholder_mask

    def placeholder_mask(input_ids, inputs_embeds, image_features=None, video_features=None):
        if input_ids is not None:
            input_ids = input_ids.masked_fill((types == 0) & (input_ids == backbone.config.image_token_id), -1)
        return own(input_ids, inputs_embeds, image_features=image_features, video_features=video_features)

    backbone.get_placeholder_mask = placeholder_mask
    try:
        yield
    finally:
        del backbone.get_placeholder_mask
