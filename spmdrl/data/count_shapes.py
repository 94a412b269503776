"""A synthetic image task for vision-language models: a small picture of k shapes, the question "How many
shapes?", the answer k (reward synthetic/count: the response must be the integer).

Rows are verl's multimodal schema: the prompt's text holds one `<image>` placeholder and the `images` column one
image as {"bytes": PNG bytes}. Pictures are drawn by a seeded RNG (shapes on a grid of cells, so they never touch);
the first n_val form the validation split and the rest train, so the files are a function of the seed.
"""
from __future__ import annotations

import io
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq

from spmdrl.data import schema
from spmdrl.errors import ConfigError

DATA_SOURCE = "synthetic/count"
QUESTION = "<image>How many shapes?"
_CELLS = 4  # the picture is a 4 x 4 grid of cells; each shape fills part of one cell
_IMAGE_TYPE = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
_EXTRA_INFO_TYPE = pa.struct([("split", pa.string()), ("index", pa.int64()), ("count", pa.int64())])


def draw(count: int, rng: random.Random, size: int = 56) -> bytes:
    """PNG bytes of a size x size picture with `count` shapes (squares or discs, random colours) in distinct
    cells of a 4 x 4 grid, on a light background."""
    from PIL import Image, ImageDraw

    if not 0 <= count <= _CELLS * _CELLS:
        raise ConfigError(f"count={count}: a picture holds 0..{_CELLS * _CELLS} shapes")
    img = Image.new("RGB", (size, size), (235, 235, 235))
    pen = ImageDraw.Draw(img)
    cell = size // _CELLS
    for c in rng.sample(range(_CELLS * _CELLS), count):
        x, y = (c % _CELLS) * cell, (c // _CELLS) * cell
        box = (x + 2, y + 2, x + cell - 3, y + cell - 3)
        colour = tuple(rng.randrange(0, 160) for _ in range(3))
        (pen.rectangle if rng.random() < 0.5 else pen.ellipse)(box, fill=colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _row(count: int, png: bytes, split: str, index: int) -> dict:
    return {
        schema.DATA_SOURCE: DATA_SOURCE,
        schema.PROMPT: [{"role": "user", "content": QUESTION}],
        schema.ABILITY: "count",
        schema.REWARD_MODEL: {"style": "rule", schema.GROUND_TRUTH: str(count)},
        schema.EXTRA_INFO: {"split": split, "index": index, "count": count},
        "images": [{"bytes": png, "path": None}],
    }


def make_count_shapes(out_dir: str, *, n_train: int = 1024, n_val: int = 64, seed: int = 0, max_count: int = 4,
                      size: int = 56, n_sft: int = 0) -> dict[str, str]:
    """Write train.parquet and val.parquet (verl's multimodal schema, 1..max_count shapes per picture of size x
    size pixels), and with n_sft > 0 sft.parquet: prompt + response rows with their images for `spmdrl sft`
    (pictures drawn after the training ones, the response the count); returns {split: path}."""
    if max_count < 1:
        raise ConfigError(f"max_count={max_count} must be at least 1")
    rng = random.Random(seed)
    os.makedirs(out_dir, exist_ok=True)
    fields = [(schema.DATA_SOURCE, pa.string()), (schema.PROMPT, pa.list_(schema.MESSAGE_TYPE)),
              (schema.ABILITY, pa.string()), (schema.REWARD_MODEL, schema.REWARD_MODEL_TYPE),
              (schema.EXTRA_INFO, _EXTRA_INFO_TYPE), ("images", _IMAGE_TYPE)]
    written = {}
    for split, n in (("val", n_val), ("train", n_train)):
        rows = []
        for i in range(n):
            count = rng.randint(1, max_count)
            rows.append(_row(count, draw(count, rng, size), split, i))
        path = os.path.join(out_dir, f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema(fields)), path)
        written[split] = path
    if n_sft > 0:
        rows = []
        for _ in range(n_sft):
            count = rng.randint(1, max_count)
            rows.append({"prompt": [{"role": "user", "content": QUESTION}], "response": str(count),
                         "images": [{"bytes": draw(count, rng, size), "path": None}]})
        written["sft"] = os.path.join(out_dir, "sft.parquet")
        pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([
            ("prompt", pa.list_(schema.MESSAGE_TYPE)), ("response", pa.string()), ("images", _IMAGE_TYPE)])),
            written["sft"])
    return written
