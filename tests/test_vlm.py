"""Vision-language models (tiny random Qwen2.5-VL): verl multimodal rows into prompt inputs, the FSDP2 engine's
forward on a micro-batch with images against transformers' own forward of each sample alone, the transformers
rollout engine with images against the actor after a weight sync, the vision tower's freeze, and the config's
refusals."""
from __future__ import annotations

import io
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist

from spmdrl.data import schema
from spmdrl.errors import ConfigError, DataError
from spmdrl.tiny import build_vlm

IMAGE_PAD = "<|image_pad|>"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(model dir, tokenizer, VisionPrompts) of a tiny Qwen2.5-VL (patch 14, 2 x 2 merge: 28 x 28 pixels per image
    token)."""
    from transformers import AutoTokenizer

    from spmdrl.data.images import VisionPrompts
    from spmdrl.models.model import load_hf_config

    d = build_vlm(str(tmp_path_factory.mktemp("vlm") / "qwen2_5_vl"), "qwen2_5_vl")
    tok = AutoTokenizer.from_pretrained(d)
    return d, tok, VisionPrompts(d, tok, load_hf_config(d))


@pytest.fixture(scope="module")
def world():
    from launching import free_port
    from spmdrl.config.schema import PlacementConfig
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield RoleMeshes(plan_layout(PlacementConfig(), 1), 0, "cpu")
    if created:
        dist.destroy_process_group()


def png(size: tuple[int, int], colour=(200, 30, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def write_rows(path, rows: list[tuple[str, list]]) -> str:
    """verl multimodal parquet: (prompt text, image items) per row."""
    items = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    table = pa.Table.from_pylist(
        [{schema.DATA_SOURCE: "synthetic/count", schema.PROMPT: [{"role": "user", "content": text}],
          schema.REWARD_MODEL: {"style": "rule", schema.GROUND_TRUTH: "1"}, "images": imgs} for text, imgs in rows],
        schema=pa.schema([(schema.DATA_SOURCE, pa.string()), (schema.PROMPT, pa.list_(schema.MESSAGE_TYPE)),
                          (schema.REWARD_MODEL, schema.REWARD_MODEL_TYPE), ("images", items)]))
    pq.write_table(table, path)
    return str(path)


def dataset(vlm, path, **kw):
    from spmdrl.data.prompts import PromptDataset

    _, tok, vision = vlm
    return PromptDataset(path, tok, max_prompt_length=kw.pop("max_prompt_length", 256), vision=vision, **kw)


# ---- data ------------------------------------------------------------------------------------------------------

def test_verl_rows_become_prompts_with_each_images_tokens(vlm, tmp_path):
    """A row with {"bytes": ...}, one with a path relative to the file, one with two images and one without: the
    rendered prompt holds each image as <|vision_start|>, one <|image_pad|> per 28 x 28 pixels, <|vision_end|>."""
    _, tok, _ = vlm
    with open(tmp_path / "dots.png", "wb") as f:
        f.write(png((84, 56)))
    path = write_rows(tmp_path / "mm.parquet", [
        ("<image>How many?", [{"bytes": png((56, 56)), "path": None}]),
        ("Count <image> please", [{"bytes": None, "path": "dots.png"}]),
        ("<image> and <image>", [{"bytes": png((56, 56)), "path": None}, {"bytes": png((28, 56)), "path": None}]),
        ("no picture", []),
    ])
    ds = dataset(vlm, path)
    pads = lambda n: "<|vision_start|>" + IMAGE_PAD * n + "<|vision_end|>"  # noqa: E731
    expected = [f"{pads(4)}How many?", f"Count {pads(6)} please", f"{pads(4)} and {pads(2)}", "no picture"]
    b = ds.batch([0, 1, 2, 3])
    for ids, text in zip(b.input_ids, expected):
        assert tok.decode(ids) == f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    assert [v.image_grid_thw.tolist() if v is not None else None for v in b.vision] == [
        [[1, 4, 4]], [[1, 4, 6]], [[1, 4, 4], [1, 4, 2]], None]
    assert b.vision[2].pixel_values.shape == (16 + 8, 3 * 2 * 14 * 14)


def test_count_shapes_task_files(vlm, tmp_path):
    from spmdrl.data.count_shapes import make_count_shapes
    from spmdrl.rewards import default_compute_score

    files = make_count_shapes(str(tmp_path), n_train=6, n_val=2, seed=3)
    ds = dataset(vlm, files["train"])
    b = ds.batch(list(range(6)))
    assert all(v.image_grid_thw.tolist() == [[1, 4, 4]] for v in b.vision)
    assert all(1 <= int(gt) <= 4 for gt in b.ground_truth)
    assert default_compute_score("synthetic/count", b.ground_truth[0], b.ground_truth[0]) == 1.0
    assert default_compute_score("synthetic/count", "0", b.ground_truth[0]) == 0.0
    assert make_count_shapes(str(tmp_path / "again"), n_train=6, n_val=2, seed=3) and \
        pq.read_table(files["train"]).equals(pq.read_table(str(tmp_path / "again" / "train.parquet")))


@pytest.mark.parametrize("rows,kw,message", [
    ([("<image>ok", [{"bytes": png((56, 56)), "path": None}]), ("<image>x", [{"bytes": b"not a png", "path": None}])],
     {}, r"row 1, column 'images': image 0: unreadable image \(UnidentifiedImageError"),
    ([("How many?", [{"bytes": png((56, 56)), "path": None}])], {},
     r"row 0, column 'images': 1 image\(s\) but 0 <image> placeholder\(s\) in the prompt"),
    ([("<image>", [{"bytes": None, "path": "missing.png"}])], {}, r"row 0, column 'images': image 0: image file 'missing.png' not found"),
    ([("<image>How many?", [{"bytes": png((280, 280)), "path": None}])], {"max_prompt_length": 30},
     r"row 0, column 'images': prompt is 46 tokens, 16 of them image tokens, over data.max_prompt_length=30"),
    ([("<image>How many?", [{"bytes": png((280, 280)), "path": None}])], {"max_prompt_length": 30, "truncation": "left"},
     r"16 of them image tokens"),
])
def test_bad_rows_one_line(vlm, tmp_path, rows, kw, message):
    path = write_rows(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError, match=message) as e:
        dataset(vlm, path, **kw)
    assert str(e.value).startswith(f"file {path}: ") and "\n" not in str(e.value)


def test_missing_images_column_and_text_model(vlm, tmp_path):
    from spmdrl.data.images import VisionPrompts
    from spmdrl.models.model import load_hf_config
    from spmdrl.tiny import build_tiny

    path = str(tmp_path / "text.parquet")
    schema.write_verl_parquet([{schema.DATA_SOURCE: "x", schema.PROMPT: [{"role": "user", "content": "hi"}],
                                schema.ABILITY: "", schema.REWARD_MODEL: {"style": "rule", "ground_truth": "1"}}], path)
    with pytest.raises(DataError, match="no column 'images' .*set data.image_key"):
        dataset(vlm, path)
    text = build_tiny(str(tmp_path / "tiny"))
    with pytest.raises(ConfigError, match="is a text model"):
        VisionPrompts(text, vlm[1], load_hf_config(text))


def test_sft_rows_with_images(vlm, tmp_path):
    """SFT's prompt + response rows with images: the prompt holds the image's tokens, the loss is on the answer and
    the end token only, each item carries its image's pixel values; a row whose images do not match its
    placeholders is refused with one line."""
    from spmdrl.data.count_shapes import make_count_shapes
    from spmdrl.data.sft import SFTDataset

    _, tok, vision = vlm
    files = make_count_shapes(str(tmp_path), n_train=1, n_val=1, n_sft=3)
    ds = SFTDataset(files["sft"], tok, 64, vision=vision)
    rows = pq.read_table(files["sft"]).to_pylist()
    for i, row in enumerate(rows):
        item = ds[i]
        answer = tok(row["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        first = item["loss_mask"].index(1)
        assert item["input_ids"][first:] == answer and sum(item["loss_mask"]) == len(answer)
        assert item["input_ids"][:first].count(vision.image_token_id) == 4
        assert item["vision"].image_grid_thw.tolist() == [[1, 4, 4]] and item["vision"].pixel_values.shape[0] == 16
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{**rows[0], "prompt": [{"role": "user", "content": "How many shapes?"}]}]),
                   bad)
    with pytest.raises(DataError, match=r"row 0, column 'images': 1 image\(s\) but 0 <image> placeholder"):
        SFTDataset(str(bad), tok, 64, vision=vision)


def test_sft_on_pictures_trains_the_language_model_only(vlm, world, tmp_path):
    """`spmdrl sft` as the VLM quickstart runs it (its config, 3 steps, world of one): the loss falls, the saved model
    is a vision-language model directory (image processor included) whose frozen tower is the original's."""
    from transformers import AutoModelForImageTextToText

    from spmdrl.config import load_config
    from spmdrl.config.schema import SFTConfig
    from spmdrl.data.count_shapes import make_count_shapes
    from spmdrl.metrics import read_jsonl
    from spmdrl.sft import run_sft, validate_sft

    data = make_count_shapes(str(tmp_path / "data"), n_train=1, n_val=1, n_sft=24)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(repo, "configs", "quickstart", "sft_vlm.toml"), [
        f"model.path={vlm[0]}", f'sft.train_files=["{data["sft"]}"]', "sft.max_steps=3", "sft.batch_size=8",
        "sft.micro_batch_size=4", "sft.warmup_steps=0", f"sft.save_dir={tmp_path / 'model'}",
        f"trainer.output_dir={tmp_path / 'out'}", "logging.progress=false", "logging.tensorboard=false"],
        root_cls=SFTConfig)
    saved = run_sft(cfg, validate_sft(cfg, 1), 0, torch.device("cpu"))
    losses = [r["sft/loss"] for r in read_jsonl(str(tmp_path / "out" / "metrics.jsonl"))]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert os.path.exists(os.path.join(saved, "preprocessor_config.json"))
    before = dict(AutoModelForImageTextToText.from_pretrained(vlm[0]).named_parameters())
    after = dict(AutoModelForImageTextToText.from_pretrained(saved).named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before if n.startswith("model.visual."))
    assert not torch.equal(before["lm_head.weight"], after["lm_head.weight"])


def geo3k_file(path, rows):
    """A file in Geometry3K's layout: (problem, answer, image items) per row."""
    items = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    pq.write_table(pa.Table.from_pylist([{"problem": p, "answer": a, "images": i} for p, a, i in rows],
                                        schema=pa.schema([("problem", pa.string()), ("answer", pa.string()),
                                                          ("images", items)])), path)
    return str(path)


def test_geo3k_converter_rows_train_as_verl_multimodal_rows(vlm, tmp_path):
    """The hub's layout (data/train-*.parquet, data/test-*.parquet), an image as bytes and one as a path: verl's
    multimodal rows that the prompt dataset reads with each image's tokens, rewarded by the boxed answer."""
    from spmdrl.data.geo3k import convert_geo3k
    from spmdrl.rewards import default_compute_score

    src = tmp_path / "geometry3k" / "data"
    src.mkdir(parents=True)
    with open(src / "diagram.png", "wb") as f:
        f.write(png((84, 56)))
    geo3k_file(src / "train-00000-of-00001.parquet", [
        ("<image>Find x. Round to the nearest tenth.", "12.5", [{"bytes": png((56, 56)), "path": None}]),
        ("Find the area of the figure.", "3\\sqrt{3}", [{"bytes": None, "path": "diagram.png"}])])
    geo3k_file(src / "test-00000-of-00001.parquet", [("<image>Find y.", "60", [{"bytes": png((28, 28)), "path": None}])])
    out = convert_geo3k(str(tmp_path / "geometry3k"), str(tmp_path / "out"))
    assert sorted(out) == ["test", "train"]
    table = pq.read_table(out["train"]).to_pylist()
    assert [r["data_source"] for r in table] == ["hiyouga/geometry3k"] * 2
    assert table[1]["prompt"][0]["content"].startswith("<image>Find the area")  # a placeholder for the diagram
    assert table[1]["images"][0]["bytes"] == open(src / "diagram.png", "rb").read()  # the path's file, read in
    ds = dataset(vlm, out["train"])
    b = ds.batch([0, 1])
    assert [v.image_grid_thw.tolist() for v in b.vision] == [[[1, 4, 4]], [[1, 4, 6]]]
    assert [tok.count(vlm[2].image_token_id) for tok in b.input_ids] == [4, 6]
    assert b.ground_truth == ["12.5", "3\\sqrt{3}"]
    score = lambda resp, truth: default_compute_score("hiyouga/geometry3k", resp, truth)  # noqa: E731
    assert score("<think>...</think> so x = \\boxed{12.50}", "12.5") == 1.0
    assert score("\\boxed{3\\sqrt{3}}", "3\\sqrt{3}") == 1.0 and score("\\boxed{3\\sqrt{2}}", "3\\sqrt{3}") == 0.0
    assert score("the answer is 12.5", "12.5") == 0.0  # not boxed
    assert score("\\boxed{60^{\\circ}}", "60") == 1.0


@pytest.mark.parametrize("rows,message", [
    ([("<image>ok", "1", [{"bytes": png((56, 56)), "path": None}]), ("<image>x", "2", [{"bytes": b"junk", "path": None}])],
     r"row 1, column 'images': image 0: unreadable image"),
    ([("<image>Find x.", None, [{"bytes": png((56, 56)), "path": None}])], r"row 0, column 'answer': is empty or null"),
    ([("Find x.", "1", [])], r"row 0, column 'images': has no image"),
    ([("<image>Find x.", "1", [{"bytes": png((56, 56)), "path": None}] * 2)],
     r"row 0, column 'images': 2 image\(s\) but 1 <image> placeholder\(s\)"),
])
def test_geo3k_converter_bad_rows_one_line(tmp_path, rows, message):
    from spmdrl.data.geo3k import convert_geo3k

    path = geo3k_file(tmp_path / "train.parquet", rows)
    with pytest.raises(DataError, match=message) as e:
        convert_geo3k(path, str(tmp_path / "out"))
    assert str(e.value).startswith(f"file {path}: ") and "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "out" / "train.parquet")


# ---- the training engine's forward -----------------------------------------------------------------------------

def samples(vlm):
    """Prompts with one image (two sizes), none, and two images, and random responses."""
    from PIL import Image

    from spmdrl.data.images import image_messages

    _, tok, vision = vlm
    g = torch.Generator().manual_seed(0)
    out = []
    for k, (sizes, text) in enumerate([([(56, 56)], "<image>How many?"), ([(84, 56)], "Count <image>"),
                                       ([], "no picture"), ([(56, 84), (28, 28)], "<image>, <image>?")]):
        msgs, _ = image_messages([{"role": "user", "content": text}])
        ids = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))["input_ids"]
        v = vision.process([Image.new("RGB", s, (60 * k, 90, 30 * k)) for s in sizes]) if sizes else None
        if v is not None:
            ids = vision.expand(ids, v.image_grid_thw)
        out.append((torch.tensor(ids), torch.randint(3, 250, (3 + k,), generator=g), v))
    return out


def alone_logprobs(model, image_token_id, prompt, response, v) -> torch.Tensor:
    """transformers' own forward of one sample (its processor's inputs), float64."""
    from spmdrl.models.vision import token_types

    x = torch.cat([prompt, response])[None]
    kw = dict(pixel_values=v.pixel_values.double(), image_grid_thw=v.image_grid_thw) if v is not None else {}
    logits = model(input_ids=x, mm_token_type_ids=token_types(x, image_token_id), **kw).logits[0, len(prompt) - 1: -1]
    return torch.log_softmax(logits, -1).gather(-1, response[:, None])[:, 0]


@pytest.fixture(scope="module")
def actor(vlm, world):
    from spmdrl.engines.fsdp import FSDPEngine

    return FSDPEngine(vlm[0], world["actor"], torch.device("cpu"), trainable=True, optim={"lr": 1e-2},
                      freeze_vision_tower=True)


def test_engine_forward_with_images_equals_each_sample_alone(vlm, actor, caplog):
    """A micro-batch asked for packed comes out as padded rows (logged); its log-probs equal transformers' float64
    forward of each sample alone: the same pixel values, grids and 3-D rotary positions."""
    import logging

    from transformers import AutoModelForImageTextToText

    from spmdrl.engines import token_batch
    from spmdrl.engines.token_batch import pack_sequences

    data = samples(vlm)
    token_batch._padded_logged = False
    with caplog.at_level(logging.INFO, logger="spmdrl"):
        tb = pack_sequences([p for p, _, _ in data], [r for _, r, _ in data], 0, packed=True,
                            vision=[v for _, _, v in data])
    assert tb.cu_seqlens is None and tb.mask.dim() == 2 and "padded rows" in caplog.text
    assert tb.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 6], [1, 6, 4], [1, 2, 2]]
    lp = actor.logprobs(tb)[0].detach()
    ref = AutoModelForImageTextToText.from_pretrained(vlm[0]).double()
    for i, (p, r, v) in enumerate(data):
        want = alone_logprobs(ref, ref.config.image_token_id, p, r, v)
        assert (lp[i, : len(r)].double() - want).abs().max().item() < 1e-5, i
        assert lp[i, len(r):].abs().sum() == 0


def test_engine_forward_qwen3_vl(world, tmp_path):
    """The same for Qwen3-VL (interleaved 3-D rotary sections, deepstack visual features into early layers)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from spmdrl.data.images import VisionPrompts
    from spmdrl.engines.fsdp import FSDPEngine
    from spmdrl.models.model import load_hf_config
    from spmdrl.engines.token_batch import pack_sequences

    d = build_vlm(str(tmp_path / "qwen3_vl"), "qwen3_vl")
    tok = AutoTokenizer.from_pretrained(d)
    data = samples((d, tok, VisionPrompts(d, tok, load_hf_config(d))))
    eng = FSDPEngine(d, world["ref"], torch.device("cpu"), trainable=False)
    tb = pack_sequences([p for p, _, _ in data], [r for _, r, _ in data], 0, vision=[v for _, _, v in data])
    lp = eng.logprobs(tb)[0]
    ref = AutoModelForImageTextToText.from_pretrained(d).double()
    assert type(ref).__name__ == "Qwen3VLForConditionalGeneration"
    for i, (p, r, v) in enumerate(data):
        assert (lp[i, : len(r)].double() - alone_logprobs(ref, ref.config.image_token_id, p, r, v)).abs().max() < 1e-5


def test_frozen_vision_tower_does_not_move(vlm, actor):
    from spmdrl.engines.token_batch import pack_sequences

    data = samples(vlm)
    tb = pack_sequences([p for p, _, _ in data], [r for _, r, _ in data], 0, vision=[v for _, _, v in data])
    before = {n: t.clone() for n, t in actor.full_state_dict().items()}
    actor.train_step([(None, tb)], lambda item, eng: (-(eng.logprobs(item[1])[0] * item[1].resp_mask).sum(), {}))
    after = actor.full_state_dict()
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    tower = {n for n in before if n.startswith("model.visual.")}
    assert tower and not moved & tower
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in moved and "lm_head.weight" in moved


def test_lora_on_the_language_model_trains_adapters_only(vlm, world, tmp_path):
    """LoRA on a vision-language model: adapters on the language model's linear layers only (none in the vision
    tower, whose MLP has layers of the same names); a step with images moves the adapters and nothing else, and
    with the adapters off the engine computes the base model (the reference policy)."""
    from spmdrl.engines.fsdp import FSDPEngine
    from spmdrl.engines.token_batch import pack_sequences
    from spmdrl.models.lora import LoraSettings, adapter_shapes
    from spmdrl.models.model import load_hf_config, model_param_shapes

    eng = FSDPEngine(vlm[0], world["actor"], torch.device("cpu"), trainable=True, optim={"lr": 1e-2},
                     lora=LoraSettings(rank=4, alpha=8))
    adapters = [n for n, p in eng.hf.named_parameters() if p.requires_grad]
    assert adapters and all(".lora_" in n and n.startswith("model.language_model.layers.") for n in adapters)
    assert sorted(adapters) == sorted(n for n, _ in adapter_shapes(model_param_shapes(load_hf_config(vlm[0])), 4, []))
    data = samples(vlm)
    tb = pack_sequences([p for p, _, _ in data], [r for _, r, _ in data], 0, vision=[v for _, _, v in data])
    base = eng.logprobs(tb)[0].detach()
    before = eng.full_state_dict()
    lora_before = {n: t.clone() for n, t in eng.adapter_tensors()}
    eng.train_step([(None, tb)], lambda item, e: (-(e.logprobs(item[1])[0] * item[1].resp_mask).sum(), {}))
    after = eng.full_state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)  # the base, tower included, stays
    moved = [n for n, t in eng.adapter_tensors() if not torch.equal(t, lora_before[n])]
    assert any(".lora_B." in n for n in moved)  # B starts at 0, so A has no gradient at the first step
    assert (eng.logprobs(tb)[0].detach() - base).abs().max() > 1e-3  # the adapters changed the policy
    ref = FSDPEngine(vlm[0], world["ref"], torch.device("cpu"), trainable=False)
    with eng.adapters_disabled():
        assert (eng.logprobs(tb)[0].detach() - ref.logprobs(tb)[0].detach()).abs().max() < 1e-6
    # the exported adapter loads in PEFT onto the model as trained: the same layers, the same log-probs
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    eng.export_hf(str(tmp_path / "adapter"))
    peft = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(vlm[0]), str(tmp_path / "adapter"))
    assert sorted(n.removeprefix("base_model.model.") for n, _ in peft.named_parameters() if ".lora_" in n) == sorted(adapters)
    lp = eng.logprobs(tb)[0].detach()
    for i, (p, r, v) in enumerate(data):
        want = alone_logprobs(peft.base_model.model.double(), vlm[2].image_token_id, p, r, v)
        assert (lp[i, : len(r)].double() - want).abs().max() < 1e-5, i


# ---- rollout with images ---------------------------------------------------------------------------------------

def test_hf_rollout_with_images_matches_the_actor_after_a_sync(vlm, actor):
    """The transformers rollout engine samples with the prompts' images; after the actor's weights (one update away
    from the checkpoint) are synced, its log-probs equal the actor's on the same images within 1e-5 (float32)."""
    from spmdrl.engines.token_batch import pack_sequences
    from spmdrl.rollout.base import SamplingSpec
    from spmdrl.rollout.hf_engine import HFEngine

    data = samples(vlm)
    eng = HFEngine(vlm[0], dtype="float32", device="cpu")
    actor_state = actor.full_state_dict()
    assert not torch.equal(actor_state["lm_head.weight"], eng.model.lm_head.weight)  # the actor has moved
    eng.update_weights(actor_state.items())
    prompts, vision = [p.tolist() for p, _, _ in data], [v for _, _, v in data]
    out = eng.generate(prompts, SamplingSpec(n=2, temperature=1.0, max_tokens=5), seeds=[1, 2, 3, 4], vision=vision)
    assert len(out.response_ids) == 8 and all(len(t) for t in out.response_ids)
    tb = pack_sequences([torch.tensor(p) for p in prompts for _ in range(2)],
                        [torch.tensor(t) for t in out.response_ids], 0, vision=[v for v in vision for _ in range(2)])
    lp = actor.logprobs(tb)[0].detach()
    for i, got in enumerate(out.logprobs):
        assert (lp[i, : len(got)] - torch.tensor(got)).abs().max().item() < 1e-5, i
    with pytest.raises(ConfigError, match="2 image inputs for 4 prompts"):
        eng.generate(prompts, SamplingSpec(max_tokens=2), seeds=[1, 2, 3, 4], vision=vision[:2])


# ---- configuration ---------------------------------------------------------------------------------------------

def test_config_refusals(vlm, tmp_path):
    from spmdrl.config import load_config
    from spmdrl.config.validate import validate_architecture
    from spmdrl.tiny import build_tiny

    def cfg(*over):
        return load_config(None, [f"model.path={vlm[0]}", *over])

    with pytest.raises(ConfigError, match="vision-language model \\(qwen2_5_vl\\); the Megatron backend trains text "
                                          "models only: set trainer.backend = 'fsdp'"):
        validate_architecture(cfg("trainer.backend=megatron", "rollout.engine=hf"))
    import importlib.util

    why = "vLLM 0.32 builds it only with torchvision installed.*" if importlib.util.find_spec("torchvision") is None else ""
    with pytest.raises(ConfigError, match=f"{why}transformers rollout engine only; set rollout.engine = 'hf'"):
        validate_architecture(cfg("rollout.engine=vllm"))
    validate_architecture(cfg("rollout.engine=hf", "actor.freeze_vision_tower=true"))
    text = build_tiny(str(tmp_path / "tiny"))
    with pytest.raises(ConfigError, match="actor.freeze_vision_tower = true: .* text model without a vision tower"):
        validate_architecture(load_config(None, [f"model.path={text}", "rollout.engine=hf",
                                                 "actor.freeze_vision_tower=true"]))
    assert os.path.exists(os.path.join(vlm[0], "preprocessor_config.json"))


def test_vlm_quickstart_configs_validate(vlm):
    """The VLM quickstart's configs (launch/quickstart.sh TASK=vlm, run shortened by tests/test_readme.py) on 2 ranks,
    and the SFT refusal of freeze_vision_tower on a text model."""
    from spmdrl.config import load_config
    from spmdrl.config.schema import SFTConfig
    from spmdrl.config.validate import validate
    from spmdrl.sft import validate_sft
    from spmdrl.tiny import build_tiny

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(repo, "configs", "quickstart", "grpo_vlm.toml"), [f"model.path={vlm[0]}"])
    validate(cfg, 2)
    assert cfg.rollout.engine == "hf" and cfg.actor.freeze_vision_tower
    sft = os.path.join(repo, "configs", "quickstart", "sft_vlm.toml")
    validate_sft(load_config(sft, [f"model.path={vlm[0]}"], root_cls=SFTConfig), 2)
    text = build_tiny(os.path.join(os.path.dirname(vlm[0]), "text"))
    with pytest.raises(ConfigError, match="sft.freeze_vision_tower = true: model.path = .* is a .qwen2. text model "
                       "without a vision tower; set it to false"):
        validate_sft(load_config(sft, [f"model.path={text}"], root_cls=SFTConfig), 2)


# ---- GRPO through the trainer ----------------------------------------------------------------------------------

def test_grpo_two_steps_on_the_count_task(vlm, tmp_path):
    """2 ranks, rollout TP = 2 (the batch moves from the rollout layout to the actor's and its images are found
    again from the dataset rows), 2 mini-batches per step (the second off-policy), frozen vision tower: both steps
    update the actor, and at step 2 (after a weight sync) the rollout's log-probs equal the actor's."""
    from launching import run

    from spmdrl.data.count_shapes import make_count_shapes
    from spmdrl.metrics import read_jsonl

    here = os.path.dirname(os.path.abspath(__file__))
    data = make_count_shapes(str(tmp_path / "data"), n_train=16, n_val=2)
    o = {"model.path": vlm[0], "data.train_files": f'["{data["train"]}"]', "data.max_prompt_length": 48,
         "data.max_response_length": 4, "data.train_batch_size": 4, "rollout.n": 2, "rollout.engine": "hf",
         "placement.rollout_tp": 2, "actor.lr": 1e-3, "actor.micro_batch_size": 2, "actor.ppo_mini_batch_size": 2,
         "actor.freeze_vision_tower": "true", "trainer.total_steps": 2, "trainer.device": "cpu",
         "rollout.parity_check": "false",  # its sync would be the first (the VLM quickstart runs the check)
         "trainer.output_dir": str(tmp_path / "out"), "logging.progress": "false", "logging.tensorboard": "false",
         "reward.custom_fn": os.path.join(here, "dist_scripts", "reward_len.py") + ":score"}
    run(["spmdrl.train", *[f"{k}={v}" for k, v in o.items()]], nproc=2, module=True)
    m = read_jsonl(str(tmp_path / "out" / "metrics.jsonl"), last_per_step=True)
    assert [r["step"] for r in m] == [1, 2]
    assert all(r["actor/grad_norm"] > 0 for r in m)
    assert m[1]["rollout/logprob_diff_max"] < 1e-5
    # the sync's own byte count against the checkpoint's tensors: each of the 2 ranks holds torch.chunk's dim-0 half
    # of every tensor (FSDP2) and receives the rest, float32; the first sync sends the whole model, the second the
    # language model only (the frozen tower is already in the rollout engine); without the parity check (whose sync
    # is not logged) step 1's is the first
    from transformers import AutoModelForImageTextToText

    tensors = dict(AutoModelForImageTextToText.from_pretrained(vlm[0]).named_parameters())

    def recv_max(names):
        def held(t, r):
            rows = torch.chunk(torch.arange(t.shape[0]), 2)
            return len(rows[r]) * t[0].numel() if r < len(rows) else 0
        return max(sum((tensors[n].numel() - held(tensors[n], r)) * 4 for n in names) for r in (0, 1))

    tower = [n for n in tensors if n.startswith("model.visual.")]
    language = [n for n in tensors if n not in tower]
    assert tower and recv_max(tower) > 0
    assert m[0]["weight_sync/bytes_recv_max"] == m[0]["weight_sync/bytes_lower_bound"] == recv_max(list(tensors))
    assert m[1]["weight_sync/bytes_recv_max"] == m[1]["weight_sync/bytes_lower_bound"] == recv_max(language)
    assert (m[0]["weight_sync/tensors"], m[1]["weight_sync/tensors"]) == (len(tensors), len(language))
