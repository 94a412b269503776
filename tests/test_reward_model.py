"""Reward model scoring: sharded scores equal an unsharded reference forward, with the policy's ids (same
tokenizer) or re-tokenised text (different tokenizer), in one process and on 2 torchrun ranks."""
import json
import os
import random
import string

import pytest
import torch
import torch.distributed as dist

from launching import free_port, run
from spmdrl.config.schema import PlacementConfig
from spmdrl.dist.layout import plan_layout
from spmdrl.dist.meshes import RoleMeshes
from spmdrl.errors import ConfigError
from spmdrl.rewards.model import RewardModelScorer, combine_rewards, same_tokenizer
from spmdrl.tiny import build_reward_model, build_tiny, build_tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128)  # tp=2 divides the heads
VARIANT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"


def variant_tokenizer():
    """A char tokenizer unlike build_tokenizer's: other special tokens, reversed ids, another chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\t\r\x0b\x0c"), reverse=True)
    vocab = {t: i for i, t in enumerate(["<pad>", "</s>", "<s>"] + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<pad>",
                                 additional_special_tokens=["<s>"])
    hf.chat_template = VARIANT_TEMPLATE
    return hf


def make_samples(tok, n=7, seed=0):
    """Chat prompts and responses of varied lengths, with the policy's ids as the trainer holds them."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        msgs = [{"role": "user", "content": f"What is {a} + {b}?" + " Think." * (i % 3)}]
        resp = f"{a} + {b} = {a + b + rng.randint(-1, 1)}" + "!" * rng.randint(0, 12)
        prompt_text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        out.append({
            "messages": msgs, "response_text": resp,
            "prompt_ids": tok(prompt_text, add_special_tokens=False)["input_ids"],
            "response_ids": tok(resp + tok.eos_token, add_special_tokens=False)["input_ids"],
        })
    return out


def fields(samples):
    return ([s["messages"] for s in samples], [s["response_text"] for s in samples],
            [s["prompt_ids"] for s in samples], [s["response_ids"] for s in samples])


def reference(model_dir, seqs):
    """Unsharded forward of each sequence alone (no padding): the score head at its last token."""
    from transformers import AutoModelForSequenceClassification

    m = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in seqs:
            x = torch.tensor([ids])
            h = m.model(input_ids=x).last_hidden_state
            out.append(float(m.score(h)[0, -1, 0]))
        assert abs(out[-1] - float(m(input_ids=x).logits[0, 0])) < 1e-6  # HF's own pooling agrees
    return torch.tensor(out)


def rendered(tok, samples):
    texts = [tok.apply_chat_template(s["messages"] + [{"role": "assistant", "content": s["response_text"]}],
                                     tokenize=False) for s in samples]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    policy = build_tokenizer()
    same = build_reward_model(str(root / "rm_same"), seed=1, **SIZES)
    other = build_reward_model(str(root / "rm_other"), seed=2, tokenizer=variant_tokenizer(), **SIZES)
    return root, policy, same, other, make_samples(policy)


@pytest.fixture(scope="module")
def mesh():
    """A world of one (gloo) in this process, and its reward-role mesh."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield RoleMeshes(plan_layout(PlacementConfig(), 1), 0, "cpu")["reward"]
    if created:
        dist.destroy_process_group()


def test_scores_equal_unsharded_reference_with_policy_ids(assets, mesh):
    _, policy, same, _, samples = assets
    scorer = RewardModelScorer(same, mesh, torch.device("cpu"), policy_tokenizer=policy, micro_batch_size=3)
    from spmdrl.engines import ScoreEngine

    assert scorer.same_tokenizer and isinstance(scorer.engine, ScoreEngine)  # the engine protocol, runtime-checked
    got = scorer.score(*fields(samples))
    assert got.dtype == torch.float32 and got.shape == (len(samples),)
    ids = [s["prompt_ids"] + s["response_ids"] for s in samples]
    ref = reference(same, ids)
    assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got, ref)
    assert ref.std() > 0.05  # the samples really score differently
    # the ids are the text's tokens: scoring the text gives the same
    text_ids = [policy(policy.apply_chat_template(s["messages"], add_generation_prompt=True, tokenize=False)
                       + s["response_text"] + policy.eos_token, add_special_tokens=False)["input_ids"] for s in samples]
    assert text_ids == ids
    # ...and the ids are what is scored: the text is not read
    msgs, _, p_ids, r_ids = fields(samples)
    bogus = scorer.score([[{"role": "user", "content": "?"}]] * len(samples), ["nonsense"] * len(samples), p_ids, r_ids)
    assert torch.equal(bogus, got)
    # batch composition does not matter (padding is masked, last token gathered from the mask)
    assert torch.allclose(scorer.score(*fields(samples[2:3])), got[2:3], atol=1e-5, rtol=0)


def test_other_tokenizer_retokenises_from_text(assets, mesh):
    _, policy, _, other, samples = assets
    scorer = RewardModelScorer(other, mesh, torch.device("cpu"), policy_tokenizer=policy, micro_batch_size=4)
    assert not scorer.same_tokenizer and not same_tokenizer(policy, scorer.tokenizer)
    tok = scorer.tokenizer
    expect = rendered(tok, samples)
    assert expect[0] != samples[0]["prompt_ids"] + samples[0]["response_ids"]
    text = tok.decode(expect[0])
    assert text.startswith("<s>user:") and "<s>assistant:" in text, text  # the reward model's own template
    msgs, texts, _, _ = fields(samples)
    empty = [[] for _ in samples]  # the policy ids are not read
    assert scorer.encode(msgs, texts, empty, empty) == expect
    got = scorer.score(msgs, texts, empty, empty)
    ref = reference(other, expect)
    assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got, ref)

    tok.chat_template = None  # no chat template: plain concatenation of the contents and the response
    plain = [tok("\n\n".join(m["content"] for m in s["messages"]) + s["response_text"])["input_ids"] for s in samples]
    assert scorer.encode(msgs, texts, empty, empty) == plain
    assert torch.allclose(scorer.score(msgs, texts, empty, empty), reference(other, plain), atol=1e-5, rtol=0)


def test_causal_lm_is_not_a_reward_model(assets, mesh):
    root, policy, _, _, _ = assets
    lm = build_tiny(str(root / "lm"), seed=0)
    with pytest.raises(ConfigError, match="reward.model_path.*score head"):
        RewardModelScorer(lm, mesh, torch.device("cpu"), policy_tokenizer=policy)
    with pytest.raises(ConfigError, match="reward.model_path"):
        RewardModelScorer(str(root / "missing"), mesh, torch.device("cpu"), policy_tokenizer=policy)


def test_combine_rewards():
    rule = torch.tensor([1.0, 0.0, 0.5])
    rm = torch.tensor([0.2, -1.0, 3.0])
    assert torch.allclose(combine_rewards(rule, rm, 1.0, 0.5), torch.tensor([1.1, -0.5, 2.0]))
    assert torch.allclose(combine_rewards(rule, rm, 0.0, 1.0), rm)
    assert torch.equal(combine_rewards([1.0, 2.0], None, 2.0, 1.0), torch.tensor([2.0, 4.0]))
    assert combine_rewards(rule, rm, 1.0, 1.0).dtype == torch.float32
    with pytest.raises(ValueError, match="shape"):
        combine_rewards(rule, rm[:2], 1.0, 1.0)


@pytest.mark.dist
def test_two_ranks_score_their_own_samples(assets, tmp_path):
    _, policy, same, other, samples = assets
    n = len(samples)
    uneven = [list(range(0, 5)), list(range(5, n))]  # 3 micro-batches of 2 on rank 0, 1 on rank 1
    cases = [
        {"name": "dp2_same", "rm": same, "tp": 1, "split": uneven},
        {"name": "dp2_other", "rm": other, "tp": 1, "split": [list(range(0, 2)), list(range(2, n))]},
        {"name": "tp2_same", "rm": same, "tp": 2, "split": [list(range(n))]},
    ]
    with open(tmp_path / "inputs.json", "w") as f:
        json.dump({"samples": samples, "cases": cases}, f)
    run([os.path.join(HERE, "dist_scripts", "reward_model_score.py"), "--out", str(tmp_path)], nproc=2, timeout=300)
    res = [json.load(open(tmp_path / f"scores_rank{r}.json")) for r in range(2)]
    from transformers import AutoTokenizer

    refs = {
        same: reference(same, [s["prompt_ids"] + s["response_ids"] for s in samples]),
        other: reference(other, rendered(AutoTokenizer.from_pretrained(other), samples)),
    }
    for case in cases:
        ref = refs[case["rm"]]
        for r in range(2):
            got = res[r][case["name"]]
            assert (got["dp"], got["tp"]) == ((2, 1) if case["tp"] == 1 else (1, 2))
            assert got["index"] == case["split"][r if case["tp"] == 1 else 0]
            assert torch.allclose(torch.tensor(got["scores"]), ref[got["index"]], atol=1e-5, rtol=0), (case, r, got)
