"""Images in prompts: verl's multimodal rows turned into a vision-language model's prompt inputs.

A row's `images` column (data.image_key) holds a list of images, each as verl stores them: a dict with the
encoded file's `bytes` (or, without bytes, a `path`), raw bytes, or a path (absolute, or relative to the data
file's folder). Each image is marked in the prompt's text by an `<image>` placeholder, in order.

`VisionPrompts` builds what the model's processor builds for Qwen2.5-VL and Qwen3-VL: the placeholders become
image parts of the messages ({"type": "image"}), the chat template renders each as
<|vision_start|><|image_pad|><|vision_end|>, the image processor turns each image into patches (pixel_values
[patches, channels * temporal_patch * patch * patch]) and its grid (image_grid_thw [images, 3]: frames, rows,
columns of patches), and each <|image_pad|> is repeated once per image token (grid / merge_size**2). It uses the
model directory's image processor and tokenizer rather than the family's processor class, which transformers 5
builds only with torchvision installed (for its video processor) and the CPU install removes torchvision.
"""
from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass

import torch

from spmdrl.data import schema
from spmdrl.errors import ConfigError

IMAGE_KEY = "images"
PLACEHOLDER = "<image>"
_SPLIT = re.compile(f"({re.escape(PLACEHOLDER)})")


@dataclass
class VisionInputs:
    """One prompt's images as the model takes them: pixel_values [patches, D] and image_grid_thw [images, 3]
    (int64), and the decoded images (for a rollout engine that runs its own processor)."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    images: list


def vision_config_of(hf_config):
    """The vision config of a vision-language model's config; None for a text model."""
    return getattr(hf_config, "vision_config", None)


def image_messages(messages: list[dict]) -> tuple[list[dict], int]:
    """verl's messages with each `<image>` placeholder turned into an image part ({"type": "image"}) between text
    parts; the number of placeholders. Messages without a placeholder keep their string content."""
    out, count = [], 0
    for m in messages:
        content = m.get("content") or ""
        if not isinstance(content, str) or PLACEHOLDER not in content:
            out.append(m)
            continue
        parts = []
        for piece in _SPLIT.split(content):
            if piece == PLACEHOLDER:
                parts.append({"type": "image"})
                count += 1
            elif piece:
                parts.append({"type": "text", "text": piece})
        out.append({**m, "content": parts})
    return out, count


def decode_image(item, base_dir: str):
    """A PIL RGB image from one item of the images column; raises ValueError saying what is wrong."""
    from PIL import Image

    if isinstance(item, dict):
        data, path = item.get("bytes"), item.get("path")
        item = data if data is not None else path
    if item is None:
        raise ValueError("an image item has neither bytes nor a path")
    if isinstance(item, (bytes, bytearray, memoryview)):
        src = io.BytesIO(bytes(item))
    elif isinstance(item, str):
        src = item if os.path.isabs(item) or os.path.exists(item) else os.path.join(base_dir, item)
        if not os.path.exists(src):
            raise ValueError(f"image file {item!r} not found")
    else:
        raise ValueError(f"an image item is a {type(item).__name__}; give bytes, a path, or {{'bytes': ...}}")
    try:
        with Image.open(src) as im:
            return im.convert("RGB")
    except Exception as e:  # noqa: BLE001 - PIL's own reason, in one line
        raise ValueError(f"unreadable image ({type(e).__name__}: {' '.join(str(e).split())})") from None


class VisionPrompts:
    """Prompt inputs of a vision-language model (module docstring): `render` for the text, `expand` for the ids
    with each image's tokens, `process` for pixel values and grids."""

    def __init__(self, model_path: str, tokenizer, hf_config):
        from transformers import AutoImageProcessor

        vision = vision_config_of(hf_config)
        if vision is None:
            raise ConfigError(f"model.path = {model_path!r} is a text model ({type(hf_config).__name__}); images in "
                              "the data need a vision-language model (Qwen2.5-VL, Qwen3-VL)")
        self.tokenizer = tokenizer
        self.image_token_id = int(hf_config.image_token_id)
        try:
            self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"model.path = {model_path!r}: no image processor could be loaded "
                              f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); the directory needs its "
                              "preprocessor_config.json") from None
        self.merge = int(getattr(self.image_processor, "merge_size", getattr(vision, "spatial_merge_size", 2)))

    def process(self, images: list) -> VisionInputs:
        """Pixel values and grids of decoded images (the image processor's own resizing and patching)."""
        out = self.image_processor(images=images, return_tensors="pt")
        return VisionInputs(out["pixel_values"], out["image_grid_thw"].long(), images)

    def tokens_per_image(self, grid: torch.Tensor) -> list[int]:
        return [int(n) for n in grid.prod(-1) // (self.merge * self.merge)]

    def expand(self, ids: list[int], grid: torch.Tensor) -> list[int]:
        """ids with image k's single image token repeated once per image token of grid[k]."""
        counts = iter(self.tokens_per_image(grid))
        out = []
        for t in ids:
            out.extend([t] * next(counts) if t == self.image_token_id else [t])
        return out


def row_images(path, row: int, column: str, items, n_placeholders: int, base_dir: str) -> list:
    """The decoded images of one row, checked against its placeholders; row errors name what is wrong."""
    items = list(items or [])
    if len(items) != n_placeholders:
        what = (f"{len(items)} image(s) but {n_placeholders} {PLACEHOLDER} placeholder(s) in the prompt; put one "
                f"{PLACEHOLDER} in the prompt's text where each image goes")
        raise schema.row_error(path, row, column, what)
    images = []
    for k, item in enumerate(items):
        try:
            images.append(decode_image(item, base_dir))
        except ValueError as e:
            raise schema.row_error(path, row, column, f"image {k}: {e}") from None
    return images
