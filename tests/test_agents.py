"""Black-box agents (spmdrl/agents/): token-in/token-out capture of a session's calls against the tokenizer's own
rendering, the endpoint's refusals, and sessions through a real in-process vLLM engine with the openai client."""
import copy
import json
import os

import pytest

from spmdrl.agents.capture import CallError, ChatRender, Session
from spmdrl.tiny import CHAT_TEMPLATE, build_tokenizer

CALL = '<tool_call>{"name": "add", "arguments": {"x": 1, "y": 2}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "add", "description": "add", "parameters": {"type": "object"}}}]
# a template that rewrites earlier assistant turns: every double quote of an assistant message becomes a single one
REWRITING = CHAT_TEMPLATE.replace("{{ m['content'] }}", "{% if m['role'] == 'assistant' %}{{ m['content'] | "
                                  "replace('\"', \"'\") }}{% else %}{{ m['content'] }}{% endif %}")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("agent_tok")))


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _session(tok, **kw):
    return Session(ChatRender(tok), max_prompt_tokens=kw.pop("max_prompt", 400),
                   max_response_tokens=kw.pop("max_response", 600), **kw)


def _sample(session, call, text, tok, end=True):
    """What the engine would return for `call`: the ids of `text` (plus EOS, sampled, when `end`)."""
    ids = _enc(tok, text) + ([tok.convert_tokens_to_ids("<|im_end|>")] if end else [])
    lps = [-0.5 - 0.01 * k for k in range(len(ids))]
    stop = {tok.convert_tokens_to_ids("<|im_end|>")}
    return ids, lps, session.finish(call, ids, lps, "stop", stop, [])


def _three_turns(tok):
    """A 3-call session: the model calls add twice (stopping at </tool_call>), gets "3" each time, then answers.
    Returns the session, the sampled ids per call, the messages of each call."""
    s = _session(tok)
    msgs = [{"role": "user", "content": "a"}]
    sampled, calls = [], []
    for k, text in enumerate([CALL, CALL, "7"]):
        call = s.prepare(copy.deepcopy(msgs), TOOLS, None)
        calls.append((call.context, copy.deepcopy(msgs)))
        ids, _, (shown, tcalls, reason) = _sample(s, call, text, tok, end=text == "7")
        sampled.append(ids)
        if tcalls:  # what an OpenAI client sends back: its assistant message, then the tool's result
            assert reason == "tool_calls" and shown == CALL
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{k}", "type": "function", "function": {"name": "add", "arguments": '{"y": 2, "x": 1}'}}]})
            msgs.append({"role": "tool", "tool_call_id": f"call_{k}", "content": "3"})
    return s, sampled, calls


@pytest.mark.quick
def test_three_turn_session_trains_the_sampled_ids_with_the_mask_on_them(tok):
    s, sampled, calls = _three_turns(tok)
    (traj,) = s.trajectories()
    assert len(traj.turns) == 3 and traj.turns[0].calls[0].name == "add"
    model = [i for i, m in zip(traj.ids, traj.mask) if m]
    assert model == sampled[0] + sampled[1] + sampled[2]  # byte for byte, in order
    # the rest is exactly the template's glue: the conversation as the template writes it, rendered in one piece
    glue = "<|im_end|>\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"
    expected = sampled[0] + _enc(tok, glue) + sampled[1] + _enc(tok, glue) + sampled[2]
    assert traj.ids == expected
    assert traj.mask == [1] * len(sampled[0]) + [0] * len(_enc(tok, glue)) + [1] * len(sampled[1]) + \
        [0] * len(_enc(tok, glue)) + [1] * len(sampled[2])
    reference = tok.apply_chat_template([{"role": "user", "content": "a"}], tools=TOOLS, tokenize=False,
                                        add_generation_prompt=True)
    assert traj.prompt == _enc(tok, reference)
    assert [c for c, _ in calls] == [traj.prompt, traj.prompt + expected[: len(sampled[0]) + len(_enc(tok, glue))],
                                     traj.prompt + expected[: -len(sampled[2])]]
    assert [lp for lp, m in zip(traj.logprobs, traj.mask) if m] == [-0.5 - 0.01 * k for ids in sampled
                                                                    for k in range(len(ids))]
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.mask) if not m)


@pytest.mark.quick
def test_a_template_that_rewrites_earlier_assistant_turns_does_not_change_the_trained_ids(tok, tmp_path):
    plain, sampled, _ = _three_turns(tok)
    rewriting = copy.deepcopy(tok)
    rewriting.chat_template = REWRITING
    s, sampled2, calls = _three_turns(rewriting)
    (a,), (b,) = plain.trajectories(), s.trajectories()
    assert sampled2 == sampled and b.ids == a.ids and b.mask == a.mask and b.prompt == a.prompt
    # re-rendering the history through that template would have trained other ids than the sampled ones
    rerender = _enc(rewriting, rewriting.apply_chat_template(calls[2][1][:2] + [{"role": "assistant", "content": CALL}],
                                                             tools=TOOLS, tokenize=False))
    assert rerender[len(b.prompt): len(b.prompt) + len(sampled[0])] != sampled[0]


@pytest.mark.quick
def test_an_edited_history_becomes_a_branch_and_a_repeat_call_forks(tok):
    s, sampled, calls = _three_turns(tok)
    msgs = calls[2][1]
    edited = copy.deepcopy(msgs)
    edited[2]["content"] = "4"  # the agent rewrote the first tool result
    call = s.prepare(edited, TOOLS, None)
    assert call.context == call.branch.traj.prompt  # not an extension: rendered whole, a new trajectory
    _sample(s, call, "8", tok)
    trajs = s.trajectories()
    assert len(trajs) == 2 and trajs[-1] is call.branch.traj
    assert [i for i, m in zip(trajs[-1].ids, trajs[-1].mask) if m] == _enc(tok, "8") + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert trajs[-1].mask == [1] * len(trajs[-1].ids) and trajs[0].ids == _three_turns(tok)[0].trajectories()[0].ids
    # two concurrent calls from the same point: the second forks the branch at that point
    first = s.prepare(copy.deepcopy(msgs), TOOLS, None)
    second = s.prepare(copy.deepcopy(msgs), TOOLS, None)
    assert second.branch is not first.branch and second.context == first.context
    # a call that gets no completion is rolled back: the same call again asks for the same context
    s.release(first)
    assert s.prepare(copy.deepcopy(msgs), TOOLS, None).context == first.context


@pytest.mark.quick
def test_every_branch_of_a_session_becomes_a_row_of_its_group(tok):
    """agent.train_branches = "all": a session's other branches (here the 3-turn conversation before its history
    was edited) become rows after its group's final branches, each with its own captured ids and mask and its
    session's outcome; a group with fewer branch rows than the step's most is filled with masked padding rows."""
    from spmdrl.agents.sessions import AgentRollout
    from spmdrl.loop.generate import PADDING, branch_rows, trajectories_to_batch

    s, _, calls = _three_turns(tok)
    first = copy.deepcopy(s.trajectories()[0])
    edited = copy.deepcopy(calls[2][1])
    edited[2]["content"] = "4"
    _sample(s, s.prepare(edited, TOOLS, None), "8", tok)
    plain, _, _ = _three_turns(tok)  # a session without branches
    finals = []
    for session, reward in ((s, 1.0), (plain, 0.0)):
        t = session.trajectories()[-1]
        t.sample, t.finish = len(finals), "answer"
        t.agent = {"reward": reward, "branches": len(session.trajectories()), "transcript": t.messages}  # as _trajectory
        finals.append(t)
    others = [AgentRollout._other_branches(x, t) for x, t in zip((s, plain), finals)]
    assert [len(o) for o in others] == [1, 0]
    (branch,) = others[0]
    assert branch.ids == first.ids and branch.mask == first.mask and branch.logprobs == first.logprobs
    assert branch.agent == {"reward": 1.0, "branches": 2, "branch": 1, "transcript": branch.messages} and branch.sample == 0
    assert branch.messages != finals[0].messages  # its own conversation, not the final branch's
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    rows, kind, session = branch_rows(finals, others, n=2, slots=2, eos=eos)
    assert rows[:3] == [finals[0], finals[1], branch] and kind == [0, 0, 1, PADDING] and session == [0, 1, 0, -1]
    batch = trajectories_to_batch(rows, [7] * 4, 1, 0)
    assert batch["index"].tolist() == [7] * 4 and batch["response_len"].tolist()[3] == 1
    assert batch["response_mask"][2, : len(first.ids)].tolist() == [float(m) for m in first.mask]
    assert float(batch["response_mask"][3].sum()) == 0.0  # padding trains nothing


@pytest.mark.quick
def test_a_sessions_branches_share_its_grpo_advantage_counted_once():
    """session_advantages against GRPO computed by hand in float64 over sessions: two groups of n = 2 sessions,
    session (0, 0) with two extra branches, a padding row; the extra branches take their session's advantage on
    their own model tokens. Counting rows as samples (plain GRPO over the batch) gives other values."""
    import torch

    from spmdrl.algos import ADV_ESTIMATORS
    from spmdrl.loop.learner import session_advantages

    grpo = ADV_ESTIMATORS.get("grpo")
    # rows: group 10: final (s0), final (s1), branch of s0, branch of s0; group 11: final, final, padding
    uid = torch.tensor([10, 10, 10, 10, 11, 11, 11])
    branch = torch.tensor([0, 0, 1, 2, 0, 0, -1])
    session = torch.tensor([0, 1, 0, 0, 0, 1, -1])
    reward = [1.0, 0.0, 1.0, 1.0, 0.5, 0.2, 0.0]
    mask = torch.zeros(7, 5)
    for i, (a, b) in enumerate([(0, 3), (0, 5), (1, 4), (2, 3), (0, 2), (0, 4), (0, 0)]):
        mask[i, a:b] = 1
    rewards = torch.zeros(7, 5)
    for i in range(7):
        if mask[i].any():
            rewards[i, int(mask[i].nonzero().max())] = reward[i]
    from spmdrl.batch import Batch

    batch = Batch({"uid": uid, "branch": branch, "session": session, "response_mask": mask,
                   "token_level_rewards": rewards})
    adv, ret = session_advantages(grpo, batch, epsilon=1e-6, norm_by_std=True)

    def by_hand(a, b):  # GRPO of a group of two sessions with rewards a, b: unbiased std over the two
        mean = (a + b) / 2
        std = (((a - mean) ** 2 + (b - mean) ** 2) / 1) ** 0.5
        return (a - mean) / (std + 1e-6), (b - mean) / (std + 1e-6)

    g10, g11 = by_hand(1.0, 0.0), by_hand(0.5, 0.2)
    per_row = [g10[0], g10[1], g10[0], g10[0], g11[0], g11[1], 0.0]
    expected = torch.tensor(per_row, dtype=torch.float64)[:, None] * mask.double()
    assert torch.allclose(adv.double(), expected, atol=1e-6) and torch.equal(adv, ret)
    plain, _ = grpo(rewards, mask, index=uid)
    assert not torch.allclose(plain[:4].double(), expected[:4], atol=1e-3)  # rows counted as samples: wrong


@pytest.mark.quick
def test_refusals_are_one_line_call_errors(tok):
    s = _session(tok, max_prompt=20)
    for bad, what in (([], "non-empty"), ([{"role": "wizard", "content": "x"}], "role"),
                      ([{"role": "user", "content": 3}], "content"), ([{"role": "user", "content": "x" * 50}], "max_prompt_length")):
        with pytest.raises(CallError, match=what) as e:
            s.prepare(bad, None, None)
        assert e.value.status == 400 and "\n" not in str(e.value)


@pytest.mark.quick
def test_streamed_text_holds_back_split_characters_calls_and_stop_strings(tok):
    """The tiny tokenizer has one token per byte, so "é" and "✓" arrive split over 2 and 3 tokens: no delta ever
    carries a broken character, the deltas put together are the reply's content, and text that may still become
    a tool call or a stop string is sent only once it cannot."""
    from spmdrl.agents.endpoint import TextStream

    render = ChatRender(tok)
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def stream(text, stops=(), calls=True, end=True):
        s = TextStream(render, {eos}, list(stops), calls)
        ids = _enc(tok, text) + ([eos] if end else [])
        return s, [s.feed([t]) for t in ids]

    s, deltas = stream("héllo ✓ done")
    assert "".join(deltas) == "héllo ✓ done" and not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d) > 5 and deltas[1] == "" and deltas[2] == "é"  # h, then é once whole
    # a tool call: the text before it is streamed (less trailing whitespace), the call never is
    s, deltas = stream("ok " + CALL)
    assert "".join(deltas) == "ok" and s.rest("ok") == ""
    assert deltas[:2] == ["o", "k"] and all(d == "" for d in deltas[2:])
    # "<" may begin a call: held back, then sent once it did not ("<b" cannot be "<tool_call>")
    s, deltas = stream("a<b", end=False)
    assert deltas == ["a", "", "<b"]
    # the agent's stop string: nothing from its first character on; the reply ends before it
    s, deltas = stream("12 STOP 34", stops=["STOP"], calls=False)
    assert "".join(deltas) == "12 " and s.rest("12 ") == ""
    s, deltas = stream("1 ST", stops=["STOP"], calls=False, end=False)
    assert "".join(deltas) == "1 " and s.rest("1 ST") == "ST"  # a length finish: the held-back rest comes last


# ---- sessions through a real engine, in this process ------------------------------------------------------------

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPERATURE = 0.3  # the run's; the agent asks for 0.7
ENGINE = os.environ.get("SPMDRL_AGENT_TEST_ENGINE", "vllm")


class Recorder:
    """The engine, with every completion it hands out kept (what was sampled, independently of the capture), its
    steps counted (`finished_at`: the step each request finished in), optionally slowed (`delay` seconds a step) and
    its weight version raised by one at step `bump_at` (as a weight update between two steps would)."""

    def __init__(self, engine):
        self.engine, self.completions, self.admitted = engine, [], []
        self.steps, self.finished_at, self.delay, self.bump_at = 0, {}, 0.0, None

    def __getattr__(self, name):
        return getattr(self.engine, name)

    @property
    def in_flight(self):
        return self.engine.in_flight

    def admit(self, ids, prompts, spec, seeds):
        self.admitted.append((ids[0], list(prompts[0]), spec.temperature))
        return self.engine.admit(ids, prompts, spec, seeds)

    def step(self, partial=False):
        import time

        if self.steps == self.bump_at:
            self.engine.weight_version += 1
        time.sleep(self.delay)
        out = self.engine.step(partial=partial)
        self.steps += 1
        done = [c for c in out if c.finished]
        self.completions += done
        self.finished_at.update((c.id, self.steps) for c in done)
        return out

    def abort(self, ids):
        out = self.engine.abort(ids)
        self.completions += out
        return out


def _batch(rows):
    from spmdrl.data.prompts import PromptBatch

    return PromptBatch(input_ids=[[1, 2, 3]] * len(rows), data_source=["t"] * len(rows),
                       ground_truth=[r.get("answer", "") for r in rows], extra_info=[r.get("extra", {}) for r in rows],
                       raw_prompt=[[{"role": "user", "content": r["letter"]}] for r in rows],
                       index=list(range(len(rows))))


@pytest.fixture(scope="module")
def served(tmp_path_factory, caplog_module):
    pytest.importorskip("openai")
    if ENGINE == "vllm":
        pytest.importorskip("vllm")
    import importlib.util
    import logging
    import time

    from launching import world_of_one
    from spmdrl.agents.endpoint import Limits
    from spmdrl.agents.sessions import AgentRollout, AgentSpec
    from spmdrl.rollout import SamplingSpec, build_engine
    from tool_agent import shared_tool_model

    model = shared_tool_model(tmp_path_factory)
    out = tmp_path_factory.mktemp("agent_runs")
    entry = os.path.join(HERE, "agent_programs.py") + ":run"
    res = {"model": model, "out": out}
    with world_of_one():
        engine = build_engine(ENGINE, model_path=model, max_model_len=512, seed=0, kv_cache_gb=0.2, tp_size=1)
        tok = engine.tokenizer
        spec = SamplingSpec(n=2, temperature=TEMPERATURE, max_tokens=300, stop_token_ids=[tok.eos_token_id])
        try:
            rec = Recorder(engine)
            rec.bump_at = 12  # every token from the 13th engine step on carries weight version 1
            react = AgentRollout(rec, tok, AgentSpec("python", entry, sessions=3, timeout_s=120),
                                 max_prompt_tokens=64, max_response_tokens=300)
            t0 = time.monotonic()
            res["react"] = react.rollout(_batch([{"letter": "b", "answer": "7"}, {"letter": "a"}, {"letter": "d"}]),
                                         [1, 2, 3], spec)
            res["react_s"], res["react_stats"] = time.monotonic() - t0, react.stats.extra
            res["react_completions"], res["react_admitted"] = list(rec.completions), list(rec.admitted)
            react.close()
            rec.bump_at = None
            rec.completions.clear()
            caplog_module.clear()
            faulty = AgentRollout(rec, tok, AgentSpec("python", entry, sessions=4, timeout_s=10,
                                                      limits=Limits(max_request_bytes=64 * 1024, max_calls=5)),
                                  max_prompt_tokens=64, max_response_tokens=300)
            rows = [{"letter": "b", "extra": {"mode": m, "out": str(out / f"{m}.json")}}
                    for m in ("faults", "flood", "crash", "hang")]
            t0 = time.monotonic()
            res["faults"] = faulty.rollout(_batch(rows), [4, 5, 6, 7], replace_n(spec, 1))
            res["faults_s"], res["faults_stats"] = time.monotonic() - t0, faulty.stats.extra
            res["fault_log"] = [r.getMessage() for r in caplog_module.records if r.name == "spmdrl.agents"
                                and r.levelno >= logging.WARNING]
            res["in_flight_after"] = engine.in_flight
            faulty.close()
            curl = AgentRollout(rec, tok, AgentSpec("command", os.path.join(HERE, "agent_curl.sh"), timeout_s=60),
                                max_prompt_tokens=64, max_response_tokens=300)
            res["curl"] = curl.rollout(_batch([{"letter": "b", "answer": "7"}]), [8], replace_n(spec, 1))
            curl.close()
            posting = AgentRollout(rec, tok, AgentSpec("command", os.path.join(HERE, "agent_curl_reward.sh"),
                                                       timeout_s=60), max_prompt_tokens=64, max_response_tokens=300)
            res["posted"] = posting.rollout(_batch([{"letter": "b", "extra": {"mode": "post"}},
                                                    {"letter": "b", "extra": {"mode": "both"}}]), [9, 10],
                                            replace_n(spec, 1))
            posting.close()
            if all(importlib.util.find_spec(m) for m in ("agents", "langgraph", "langchain_openai")):
                rec.completions.clear()
                rec.admitted.clear()
                sdks = AgentRollout(rec, tok, AgentSpec("python", entry, sessions=2, timeout_s=120),
                                    max_prompt_tokens=64, max_response_tokens=300)
                res["sdks"] = sdks.rollout(_batch([{"letter": "d", "extra": {"mode": "openai_agents"}},
                                                   {"letter": "d", "extra": {"mode": "langgraph"}}]), [12, 13],
                                           replace_n(spec, 1))
                res["sdks_stats"], res["sdks_completions"] = sdks.stats.extra, list(rec.completions)
                res["sdks_admitted"] = list(rec.admitted)
                sdks.close()
            res["serve"] = _serve_calls(rec)
        finally:
            engine.close()
        res["moe"] = _moe_session(out, entry)
    yield res


def _moe_session(out, entry):
    """Routing replay with agents: a tiny Qwen3-MoE (untrained) in a vLLM engine that records routes, one session of
    two chat calls (the second extends the first)."""
    from spmdrl.agents.sessions import AgentRollout, AgentSpec
    from spmdrl.rollout import SamplingSpec, build_engine
    from spmdrl.tiny import build_tiny

    model = build_tiny(str(out / "moe"), seed=0, arch="qwen3_moe", num_layers=2)
    engine = build_engine("vllm", model_path=model, max_model_len=256, seed=0, kv_cache_gb=0.05, tp_size=1,
                          capture_routes=True)
    try:
        tok = engine.tokenizer
        rollout = AgentRollout(engine, tok, AgentSpec("python", entry, timeout_s=60), max_prompt_tokens=64,
                               max_response_tokens=100)
        spec = SamplingSpec(n=1, temperature=1.0, max_tokens=100, stop_token_ids=[tok.eos_token_id])
        (t,) = rollout.rollout(_batch([{"letter": "q", "extra": {"mode": "two_calls"}}]), [11], spec)
        rollout.close()
    finally:
        engine.close()
    return {"model": model, "traj": t}


def _serve_calls(engine):
    """spmdrl serve's loop on the fixture's engine, called with the openai client from a thread."""
    import threading

    from openai import OpenAI

    from agent_programs import TOOLS as AGENT_TOOLS
    from spmdrl.rollout import SamplingSpec
    from spmdrl.serve import serve_model

    stop, out, ready = threading.Event(), {}, threading.Event()

    def client_calls():
        try:
            ready.wait(60)
            client = OpenAI(base_url=out["url"], api_key="k3y", max_retries=0, timeout=60)
            out["models"] = [m.id for m in client.models.list().data]
            r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "b"}],
                                               tools=AGENT_TOOLS)
            out["chat"] = r.choices[0].message.content
            r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}],
                                               tools=AGENT_TOOLS)
            out["call"] = [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
            out["finish"] = r.choices[0].finish_reason
            r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}],
                                               tools=AGENT_TOOLS, tool_choice="none", parallel_tool_calls=True,
                                               max_completion_tokens=100, store=False, metadata={"k": "v"}, user="u")
            choice = r.choices[0]
            out["no_calls"] = (choice.message.content, choice.message.tool_calls, choice.finish_reason)
            text = "".join(c.choices[0].text for c in [client.completions.create(
                model="x", prompt="<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n", max_tokens=4)])
            out["completion"] = text
            try:
                OpenAI(base_url=out["url"], api_key="wrong", max_retries=0).models.list()
            except Exception as e:
                out["wrong_key"] = getattr(e, "status_code", None)
            # streamed replies, each against the same request unstreamed (greedy: the same tokens), the engine slowed
            # to 50 ms a step while a text streams: each chunk notes the engine's step count when it arrived
            prompt = "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n"
            out["text_plain"] = client.completions.create(model="x", prompt=prompt, max_tokens=16).choices[0].text
            engine.delay = 0.05
            out["text_chunks"] = [(ch.id, ch.choices[0].text, ch.choices[0].finish_reason, engine.steps) for ch in
                                  client.completions.create(model="x", prompt=prompt, max_tokens=16, stream=True)]
            engine.delay = 0.0
            out["text_finished_at"] = engine.finished_at[out["text_chunks"][0][0].removeprefix("cmpl-")]
            d = [{"role": "user", "content": "d"}]
            for turn in ("call", "answer"):  # d calls boom (a streamed tool call), then answers "ok" (streamed text)
                plain = client.chat.completions.create(model="x", messages=d, tools=AGENT_TOOLS)
                engine.delay = 0.05 if turn == "answer" else 0.0
                chunks = [(ch.model_dump(exclude_none=True), engine.steps) for ch in client.chat.completions.create(
                    model="x", messages=d, tools=AGENT_TOOLS, stream=True)]
                out[f"chat_{turn}"] = (plain.choices[0].message.model_dump(exclude_none=True),
                                       plain.choices[0].finish_reason, chunks,
                                       engine.finished_at[chunks[0][0]["id"].removeprefix("chatcmpl-")])
                d = d + [out[f"chat_{turn}"][0], {"role": "tool", "tool_call_id": "call_0",
                                                  "content": "error: RuntimeError: boom"}]
            engine.delay = 0.0
        except Exception as e:
            out["error"] = repr(e)
        finally:
            stop.set()

    def on_ready(url):
        out["url"] = url
        ready.set()

    t = threading.Thread(target=client_calls)
    t.start()
    serve_model("tool_model", secret="k3y", port=0, spec=SamplingSpec(temperature=0.0, max_tokens=120), max_model_len=512,
                engine=engine, stop=stop, on_ready=on_ready)
    t.join()
    return out


def replace_n(spec, n):
    from dataclasses import replace

    return replace(spec, n=n)


@pytest.fixture(scope="module")
def caplog_module():
    """Log records of the module's fixture (pytest's caplog is per test)."""
    import logging

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.records = []

        def emit(self, record):
            self.records.append(record)

        def clear(self):
            self.records = []

    h = Keep()
    logging.getLogger("spmdrl.agents").addHandler(h)
    yield h
    logging.getLogger("spmdrl.agents").removeHandler(h)


def _model_runs(t):
    """(start, ids) of each run of mask-1 tokens."""
    runs = []
    for k, m in enumerate(t.mask):
        if m and (k == 0 or not t.mask[k - 1]):
            runs.append((k, []))
        if m:
            runs[-1][1].append(t.ids[k])
    return runs


def test_react_agent_sessions_train_exactly_what_was_sampled(served):
    """Six sessions of a ReAct agent (openai client, one streamed call each) through the endpoint: every model-token
    run of a trajectory is one completion the engine returned, with its log-probs; the tool and glue tokens between
    are the context the next request was admitted with; the agent's temperature 0.7 was overridden by the run's."""
    trajs, comps = served["react"], served["react_completions"]
    assert len(trajs) == 6 and all(t.finish == "answer" for t in trajs), [(t.finish, t.agent.get("error"), [x.text[:60] for x in t.turns]) for t in trajs]
    context = {rid: tuple(p) for rid, p, _ in served["react_admitted"]}
    assert {temp for _, _, temp in served["react_admitted"]} == {TEMPERATURE}
    sampled = {}  # (context, token ids, log-probs) of every request the engine finished
    for c in comps:
        sampled.setdefault((context[c.id], tuple(c.token_ids)), []).append(c.logprobs)
    for t in trajs:
        runs = _model_runs(t)
        assert runs and len(runs) == len(t.turns)
        for at, run in runs:
            # admitted on exactly this context, sampled as a whole, byte for byte, with these log-probs
            assert t.logprobs[at: at + len(run)] in sampled[(tuple(t.prompt + t.ids[:at]), tuple(run))]
    b, a, d = trajs[0], trajs[2], trajs[4]
    assert b.agent["reward"] == 1.0 and len(b.turns) == 1 and b.turns[0].text == "7"
    assert len(a.turns) == 3 and a.agent["reward"] == 0.0 and all(turn.calls for turn in a.turns)
    assert [r.text for r in a.turns[0].results] == ["3"] and a.turns[0].appended
    assert len(d.turns) == 2 and d.turns[0].calls[0].name == "boom"
    stats = served["react_stats"]
    assert stats["agent/sessions"] == 6 and stats["agent/failed_sessions"] == 0 and stats["agent/branches"] == 6
    assert stats["agent/calls"] == sum(len(t.turns) for t in trajs) and stats["agent/endpoint_errors"] == 0


def test_trajectory_logprobs_equal_a_transformers_forward_over_the_whole_trajectory(served):
    """Independent of the engine's own bookkeeping: one fp32 forward of the model over prompt + ids gives, at every
    model token, the log-prob the engine sampled it with at the run's temperature (so the context every call ran on is the trajectory)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(served["model"], dtype=torch.float32).eval()
    worst = 0.0
    for t in served["react"]:
        ids = torch.tensor([t.prompt + t.ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(t.prompt) - 1: -1]
        lp = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, torch.tensor(t.ids)[:, None])[:, 0]
        mask = torch.tensor(t.mask, dtype=torch.bool)
        worst = max(worst, float((lp[mask] - torch.tensor(t.logprobs)[mask]).abs().max()))
    assert worst < 1e-4, worst


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting for init to reap it is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_faults_each_give_one_line_and_no_hang(served):
    faults, flood, crash, hang = served["faults"]
    out = served["out"]
    codes = json.load(open(out / "faults.json"))
    assert codes == {"malformed": 400, "no_secret": 401, "wrong_secret": 401, "too_big": 413, "too_long": 400,
                     "n2": 400, "good": 200}
    assert faults.agent["reward"] == 0.5 and faults.finish == "answer" and sum(faults.mask) > 0
    assert json.load(open(out / "flood.json")) == [200] * 5 + [429] * 3
    assert crash.finish == "error" and "RuntimeError: the agent fell over" in crash.agent["error"]
    assert hang.finish == "error" and "timeout_s" in hang.agent["error"] and sum(hang.mask) == 0
    child = json.load(open(out / "hang.json"))["child"]
    assert not _running(child)  # what the hanging agent started died with it
    assert crash.agent["reward"] == 0.0 and sum(crash.mask) == 0
    assert served["faults_s"] < 60 and served["in_flight_after"] == 0
    log = served["fault_log"]
    assert all("\n" not in line for line in log)
    for what in ("400 the request body is not valid JSON", "401 missing or wrong API key", "413 the request has",
                 "400 the prompt renders to", "429 session", "failed: raised RuntimeError", "ran past agent.timeout_s"):
        assert sum(what in line for line in log) >= 1, (what, log)
    assert served["faults_stats"]["agent/failed_sessions"] == 2


def test_serve_answers_the_openai_client_without_sessions(served):
    """spmdrl serve's endpoint (greedy): /v1/models, a chat answer, a parsed tool call, /v1/completions, and 401."""
    from tool_agent import CALL_ADD

    out = served["serve"]
    assert "error" not in out, out["error"]
    assert out["models"] == ["policy"] and out["chat"] == "7" and out["wrong_key"] == 401
    assert out["call"] == [("add", {"x": 1, "y": 2})] and out["finish"] == "tool_calls"
    assert out["completion"] == "7"
    # tool_choice "none" (with fields the Agents SDK and LangChain send): the same call, as text
    content, calls, finish = out["no_calls"]
    assert calls is None and finish == "stop" and content.startswith(CALL_ADD), out["no_calls"]


def test_openai_agents_sdk_and_langgraph_agents_run_sessions(served):
    """An OpenAI Agents SDK agent and a LangGraph ReAct agent (tests/agent_programs.py) through the endpoint: each
    calls boom, gets its result, answers "ok"; each session is one branch (what the SDK sends back extends what it
    got), its model tokens are the engine's completions on exactly the contexts they were sampled on."""
    pytest.importorskip("agents")
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    trajs, stats = served["sdks"], served["sdks_stats"]
    assert [t.agent.get("reward") for t in trajs] == [1.0, 1.0], [(t.agent, [x.text for x in t.turns]) for t in trajs]
    assert stats["agent/sessions"] == 2 and stats["agent/failed_sessions"] == 0 and stats["agent/branches"] == 2
    assert stats["agent/endpoint_errors"] == 0
    context = {rid: tuple(p) for rid, p, _ in served["sdks_admitted"]}
    sampled = {(context[c.id], tuple(c.token_ids)): c.logprobs for c in served["sdks_completions"]}
    for t in trajs:
        assert [turn.calls[0].name if turn.calls else turn.text for turn in t.turns] == ["boom", "ok"]
        assert t.turns[0].appended and [r.text for r in t.turns[0].results] == ["error: RuntimeError: boom"]
        runs = _model_runs(t)
        assert len(runs) == 2
        for at, run in runs:
            assert t.logprobs[at: at + len(run)] == sampled[(tuple(t.prompt + t.ids[:at]), tuple(run))]


def test_a_bash_and_curl_agent_runs_a_session(served):
    (t,) = served["curl"]
    assert t.finish == "answer" and t.agent["reward"] == 1.0 and t.turns[0].text == "7" and sum(t.mask) == 2


def test_streamed_replies_arrive_as_the_tokens_are_sampled(served):
    """Streamed through the endpoint with the openai client: a 16-token completion comes in more than one text chunk,
    the first while the engine was still sampling it (its step count below the step the request finished in), and
    the chunks put together are the unstreamed reply. A chat reply streams its text the same way; a tool call comes
    whole before the last chunk, as the unstreamed reply's tool_calls."""
    out = served["serve"]
    assert "error" not in out, out["error"]
    chunks = out["text_chunks"]
    texts = [(text, step) for _, text, _, step in chunks if text]
    assert len(texts) > 1 and texts[0][1] < out["text_finished_at"], (texts, out["text_finished_at"])
    assert "".join(t for t, _ in texts) == out["text_plain"] and len(out["text_plain"]) == 16
    assert chunks[-1][2] == "length"
    for turn in ("call", "answer"):
        plain, reason, chunks, finished_at = out[f"chat_{turn}"]
        deltas = [c["choices"][0]["delta"] for c, _ in chunks if c["choices"]]
        content = [(d["content"], step) for d, (c, step) in zip(deltas, chunks) if d.get("content")]
        calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
        assert "".join(t for t, _ in content) == (plain.get("content") or "")
        assert [{k: v for k, v in tc.items() if k != "index"} for tc in calls] == plain.get("tool_calls", [])
        assert chunks[-1][0]["choices"][0]["finish_reason"] == reason
        if turn == "call":
            assert reason == "tool_calls" and calls[0]["function"]["name"] == "boom" and not content
        else:  # "ok": one chunk a token, the first before the request finished (at its end token)
            assert plain["content"] == "ok" and [t for t, _ in content] == ["o", "k"] and content[0][1] < finished_at


def test_every_captured_token_carries_the_weight_version_that_sampled_it(served):
    """The react sessions ran while the engine's weight version went from 0 to 1 (at its 13th step): each model
    token of a trajectory carries the version of the step that sampled it (the completions' own), some requests
    were sampled under both, and a glue token carries the version of the token before it."""
    trajs, comps = served["react"], served["react_completions"]
    versions = {tuple(c.token_ids): [] for c in comps}
    for c in comps:
        versions[tuple(c.token_ids)].append(c.versions)
    assert any(set(c.versions) == {0, 1} for c in comps)  # a call in flight across the change
    for t in trajs:
        assert len(t.versions) == len(t.ids)
        for at, run in _model_runs(t):
            assert t.versions[at: at + len(run)] in versions[tuple(run)]
        for k, m in enumerate(t.mask):
            if not m:
                assert k > 0 and t.versions[k] == t.versions[k - 1]
    seen = {v for t in trajs for v in t.versions}
    assert seen == {0, 1}, seen


def test_an_agent_can_post_its_reward_to_the_endpoint(served):
    """A bash+curl agent posts its reward (a malformed post got 400, one without the key 401, else the script
    fails): the session's reward is the posted one; an agent that also prints a reward gets the printed one."""
    post, both = served["posted"]
    assert post.finish == both.finish == "answer", (post.agent, both.agent)
    assert post.agent["reward"] == 1.0 and both.agent["reward"] == 0.25


def test_agent_sessions_keep_the_routes_transformers_routes_with(served):
    """Routing replay with agents: on a tiny Qwen3-MoE whose vLLM engine records routes, a session of two chat calls
    keeps, for every position of its trajectory the engine computed (all but the last token), the experts of every
    layer; transformers' own router over prompt + ids picks the same ones (route agreement 1.0)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    moe = served["moe"]
    t = moe["traj"]
    assert t.finish in ("answer", "length") and len(t.turns) == 2 and t.agent["reward"] == 1.0, t.agent
    assert sum(t.mask) > 0 and 0 in t.mask  # the model's tokens of both calls, the glue between
    model = AutoModelForCausalLM.from_pretrained(moe["model"], dtype=torch.float32).eval()
    ids = t.prompt + t.ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), output_router_logits=True).router_logits
    top_k = model.config.num_experts_per_tok
    hf = np.stack([lg.topk(top_k, dim=-1).indices.sort(-1).values.numpy() for lg in logits], 1)
    got = np.sort(np.asarray(t.routes), -1)
    assert got.shape == (len(ids) - 1, len(logits), top_k), got.shape
    agree = float((got == hf[: len(ids) - 1]).all(-1).mean())
    assert agree == 1.0, agree


# ---- through the Trainer: 2 ranks, rollout TP = 2 ---------------------------------------------------------------

def _letters_data(root):
    import pyarrow as pa

    from spmdrl.data import schema

    def row(letter, i):
        return {schema.DATA_SOURCE: "agenttest", schema.PROMPT: [{"role": "user", "content": letter}],
                schema.ABILITY: "tools", schema.REWARD_MODEL: {"style": "rule", schema.GROUND_TRUTH: "7" if letter == "b" else ""},
                schema.EXTRA_INFO: {"letter": letter, "index": i, "mode": "graded"}}

    info = pa.struct([("letter", pa.string()), ("index", pa.int64()), ("mode", pa.string())])
    root.mkdir(parents=True, exist_ok=True)
    return {split: schema.write_verl_parquet([row(x, i) for i, x in enumerate(letters)], root / f"{split}.parquet",
                                             extra_info_type=info)
            for split, letters in (("train", "badbbadb"), ("val", "ba"))}


@pytest.mark.dist
def test_agent_sessions_train_through_the_trainer(tmp_path_factory, tmp_path):
    """One launch on 2 ranks with rollout TP = 2, every rollout an agent session through rank 0's endpoint while
    rank 1 steps the same requests (grpo_step.py --runs: two Trainer runs in one process group).

    1. Two GRPO steps of the openai-client ReAct agent, graded so that the two sessions of a prompt differ: the
       agent's rewards are the scores, the trajectories train (the actor moved), and at step 2 vLLM's log-probs of
       the trained tokens equal the actor's over the whole trajectories (the trained ids are the sampled ids, in the
       contexts they were sampled in).
    2. One GRPO step of a bash script with curl (tests/agent_curl.sh, agent.command) whose sessions make two calls
       that do not extend each other (two branches): each branch is a row of the batch the update trains on, with
       the loss mask on exactly the tokens vLLM sampled for it, the script's printed reward as its score, and its
       session's GRPO advantage (the group's statistics over sessions, not rows); the gradient is not zero."""
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    import torch

    from launching import run
    from spmdrl.metrics import read_jsonl
    from spmdrl.rollout.trajectory import decode_infos
    from tool_agent import shared_tool_model

    model = shared_tool_model(tmp_path_factory)
    data = _letters_data(tmp_path / "data")
    react_out, curl_out, dump = tmp_path / "react", tmp_path / "curl", tmp_path / "dump"
    for d in (react_out, curl_out, dump):
        d.mkdir()
    o = {
        "model.path": model, "data.train_files": f'["{data["train"]}"]', "data.val_files": f'["{data["val"]}"]',
        "data.max_prompt_length": 64, "data.max_response_length": 300, "data.train_batch_size": 2,
        "data.shuffle": "false", "rollout.n": 2, "rollout.kv_cache_gb": 0.2, "rollout.temperature": TEMPERATURE,
        "rollout.val_temperature": 0.0, "placement.rollout_tp": 2, "actor.lr": 1e-4, "actor.micro_batch_size": 2,
        "actor.ppo_mini_batch_size": 2, "trainer.total_steps": 2, "trainer.device": "cpu",
        "trainer.output_dir": str(react_out), "logging.progress": "false",
        "reward.custom_fn": os.path.join(HERE, "dist_scripts", "reward_const.py") + ":score",
        "agent.enable": "true", "agent.entry": os.path.join(HERE, "agent_programs.py") + ":run",
        "agent.sessions": 4, "agent.timeout_s": 120,
    }
    curl = {**o, "agent.entry": "", "agent.command": f"bash {os.path.join(HERE, 'agent_curl.sh')} branch",
            "trainer.total_steps": 1, "data.val_files": "[]", "trainer.output_dir": str(curl_out),
            "hooks.files": f'["{os.path.join(HERE, "dist_scripts", "dump_hook.py")}"]'}
    runs = [{"out": str(react_out), "overrides": [f"{k}={v}" for k, v in o.items()]},
            {"out": str(curl_out), "overrides": [f"{k}={v}" for k, v in curl.items()],
             "env": {"SPMDRL_TEST_DUMP": str(dump)}}]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    run([os.path.join(HERE, "dist_scripts", "grpo_step.py"), "--runs", str(tmp_path / "runs.json")], nproc=2,
        timeout=900)

    rows = read_jsonl(str(react_out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    val, s1, s2 = rows
    assert val["val/accuracy"] == 0.5  # greedy: b answers 7 (the agent's reward 1), a never answers (0)
    for s in (s1, s2):
        assert s["agent/sessions"] == 4 and s["agent/failed_sessions"] == 0 and s["agent/calls"] >= 4
        assert s["multi_turn/turns_max"] >= 2 and s["multi_turn/tool_tokens_mean"] > 0
    assert s1["actor/grad_norm"] > 0
    # the agents' rewards (the second session of a prompt gets 0.5 more), not the reward function's constant 1:
    # step 1 is b, b, a, a: (1 + 1.5 + 0 + 0.5) / 4; step 2 is d, d, b, b: (0 + 0.5 + 1 + 1.5) / 4
    assert s1["train/reward_mean"] == s2["train/reward_mean"] == 0.75
    assert s2["rollout/logprob_diff_max"] < 1e-4
    documented = open(os.path.join(os.path.dirname(HERE), "docs", "metrics.md")).read()
    assert all(f"`{k}`" in documented for k in s1 if k.startswith("agent/"))
    checks = [json.load(open(react_out / f"check_rank{r}.json")) for r in range(2)]
    assert checks[0]["param_change"] > 0 and checks[0]["weight_sync_max_diff"] < 1e-4

    # the bash + curl agent, two branches a session: every branch a row of the batch the update trained on
    (c1,) = read_jsonl(str(curl_out / "metrics.jsonl"))
    assert c1["agent/sessions"] == 4 and c1["agent/failed_sessions"] == 0 and c1["agent/calls"] == 8
    assert c1["agent/branches"] == 8 and c1["agent/branch_rows"] == 4
    assert c1["actor/grad_norm"] > 0 and c1["train/reward_mean"] == 1.25  # (1 + 1.5) per prompt: its printed rewards
    tok = _tokenizer(model)
    seven = tok.encode("7", add_special_tokens=False) + [tok.eos_token_id]
    # GRPO over the 2 sessions of a group (rewards 1 and 1.5), by hand; counting the branches as samples would give
    # 0.25 / std(1, 1, 1.5, 1.5) = 0.866 instead
    expected = {1.0: -0.25 / (0.125 ** 0.5 + 1e-6), 1.5: 0.25 / (0.125 ** 0.5 + 1e-6)}
    sessions = {}
    for r in range(2):
        b = torch.load(dump / f"batch_rank{r}.pt")
        assert len(b["responses"]) == 4 and b["branch"].tolist() == [0, 0, 1, 1]  # one group a rank, no padding
        for i, info in enumerate(decode_infos(b["trajectory"])):
            n = int(b["response_len"][i])
            ids, mask = b["responses"][i, :n].tolist(), b["response_mask"][i, :n].tolist()
            assert mask == [1.0] * n and (b["rollout_log_probs"][i, :n] <= 0).all()  # one call: every token sampled
            assert tok.decode(ids).startswith(info["turns"][0]["text"])
            reward = info["agent"]["reward"]
            assert float(b["scores"][i]) == reward and reward in expected
            assert torch.allclose(b["advantages"][i, :n].double(), torch.full((n,), expected[reward], dtype=torch.float64),
                                  atol=1e-5)
            sessions.setdefault((int(b["uid"][i]), int(b["session"][i])), []).append(ids)
    assert len(sessions) == 4 and all(len(v) == 2 for v in sessions.values())
    assert all(seven in v and any(x != seven for x in v) for v in sessions.values())  # its "b" call and its "a" call


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.mark.quick
def test_agent_config_refusals():
    from spmdrl.config import load_config
    from spmdrl.config.validate import validate_agent
    from spmdrl.errors import ConfigError

    entry = os.path.join(HERE, "agent_programs.py") + ":run"
    ok = load_config(None, ["agent.enable=true", f"agent.entry={entry}"])
    validate_agent(ok)
    for overrides, what in (
        ([], "exactly one of agent.entry"),
        ([f"agent.entry={entry}", "agent.command=bash x.sh"], "exactly one of agent.entry"),
        (["agent.entry=missing.py:run"], "file missing.py not found"),
        (["agent.entry=nocolon"], "expected 'path/to/file.py:run'"),
        ([f"agent.entry={entry}", "agent.sessions=0"], "agent.sessions must be >= 1"),
        ([f"agent.entry={entry}", "agent.timeout_s=0"], "agent.timeout_s must be > 0"),
        ([f"agent.entry={entry}", "agent.tool_format=xml"], "agent.tool_format must be one of"),
        ([f"agent.entry={entry}", "multi_turn.enable=true"], "two ways to roll out"),
        ([f"agent.entry={entry}", "rollout.partial=keep"], "rollout.partial = 'off'"),
        ([f"agent.entry={entry}", "agent.train_branches=some"], "agent.train_branches must be one of all, last"),
        ([f"agent.entry={entry}", "algorithm.filter_groups=true"], "set agent.train_branches = 'last'"),
        ([f"agent.entry={entry}", "placement.mode=split"], "set agent.train_branches = 'last'"),
    ):
        with pytest.raises(ConfigError, match=what):
            validate_agent(load_config(None, ["agent.enable=true", *overrides]))


@pytest.mark.quick
def test_the_agent_quickstart_is_the_tool_quickstart_with_an_agent():
    """configs/quickstart/grpo_agent.toml (TASK=agent) validates on 2 ranks and differs from grpo_tools.toml
    (TASK=tools) only in how it rolls out, and its agent shows the model the calculator schema the in-process loop
    writes into the prompt, with results cut as multi_turn.max_tool_response_tokens cuts them (byte-level
    tokenizer: one token per character)."""
    import dataclasses
    import importlib.util

    from spmdrl.config import load_config, validate
    from spmdrl.tools.builtin import calculator_tool

    root = os.path.dirname(HERE)
    agent_cfg = load_config(os.path.join(root, "configs", "quickstart", "grpo_agent.toml"))
    tools_cfg = load_config(os.path.join(root, "configs", "quickstart", "grpo_tools.toml"))
    validate(agent_cfg, 2)
    a, t = dataclasses.asdict(agent_cfg), dataclasses.asdict(tools_cfg)
    assert a["agent"]["enable"] and not a["multi_turn"]["enable"] and t["multi_turn"]["enable"]
    for cfg in (a, t):
        cfg.pop("agent"), cfg.pop("multi_turn"), cfg["trainer"].pop("output_dir")
    assert a == t
    spec = importlib.util.spec_from_file_location("agent_react", os.path.join(root, agent_cfg.agent.entry.split(":")[0]))
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    assert json.dumps(agent.TOOLS) == json.dumps([calculator_tool().schema()])
    assert agent.MAX_TURNS == tools_cfg.multi_turn.max_turns
    assert agent.MAX_RESULT_CHARS == tools_cfg.multi_turn.max_tool_response_tokens
    assert agent.calculator('{"expression": "1234567+89012"}') == "1323579"
    assert agent.reward(" 1323579", "1323579") == 1.0 and agent.reward("1323579 ", "1323578") == 0.0
