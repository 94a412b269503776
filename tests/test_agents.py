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


def test_refusals_are_one_line_call_errors(tok):
    s = _session(tok, max_prompt=20)
    for bad, what in (([], "non-empty"), ([{"role": "wizard", "content": "x"}], "role"),
                      ([{"role": "user", "content": 3}], "content"), ([{"role": "user", "content": "x" * 50}], "max_prompt_length")):
        with pytest.raises(CallError, match=what) as e:
            s.prepare(bad, None, None)
        assert e.value.status == 400 and "\n" not in str(e.value)
