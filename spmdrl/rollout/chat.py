"""Chat-template glue between the turns of a multi-turn rollout.

After a turn the model sampled, what follows in the token sequence is what the chat template writes between
that assistant text and the next assistant text: the end of the assistant message the model did not sample
(e.g. the newline after `<|im_end|>`, or the whole `<|im_end|>\\n` when the turn stopped at `</tool_call>`),
the tool messages, and the generation prompt. It is found by rendering the conversation without and with them
and taking the difference:

    glue = render(history + [assistant(turn)] + tool_messages, generation prompt)
           minus render(history, generation prompt) + turn

which is correct only if the template is prefix-preserving: rendering a longer conversation never changes how
the earlier part is written. `ChatGlue` checks that on a probe conversation when it is built and refuses
templates that rewrite earlier turns (e.g. ones that strip the reasoning of earlier assistant turns), and
checks it again on every real turn. The glue is tokenized on its own; the model's sampled ids are never
re-tokenized.
"""
from __future__ import annotations

from spmdrl.errors import ConfigError, SpmdrlError

_PROBE_CALL = '<tool_call>{"name": "probe", "arguments": {"x": 1}}</tool_call>'
_PROBE_TURNS = ("<think>first thought</think>I will call a tool. " + _PROBE_CALL,
                "<think>second thought</think>" + _PROBE_CALL,
                "<think>third thought</think>The answer is 1.")


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def tool_message(text: str, name: str = "") -> dict:
    m = {"role": "tool", "content": text}
    if name:
        m["name"] = name
    return m


class ChatGlue:
    """Renders the glue after a turn as token ids with the tokenizer's chat template.

    tools: the tool schemas the template gets (`tools=`), the same ones the prompts were rendered with."""

    def __init__(self, tokenizer, tools: list[dict] | None = None, *, name: str = ""):
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.name = name or getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"multi_turn.enable: the tokenizer {self.name} has no chat template; multi-turn rollouts "
                              "render tool results with it: use an instruct model's tokenizer (model.tokenizer_path)")
        self.probe()

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def glue_text(self, history: list[dict], turn_text: str, tool_messages: list[dict], sampled_end: str = "") -> str:
        """The text that follows the model's sampled turn. history: the messages before this assistant turn;
        turn_text: the turn's text without the stop token it ended with; sampled_end: the text of that stop token
        ('' when the turn ended at a stop string), which the model already sampled and is not glue."""
        short = self.render(history, True) + turn_text
        long = self.render([*history, assistant(turn_text), *tool_messages], True)
        if not long.startswith(short):
            raise SpmdrlError(
                f"the chat template of {self.name} rendered a conversation whose earlier part changed once a turn "
                f"was added (at character {_first_difference(short, long)}); multi-turn rollouts need a "
                "prefix-preserving template (model.tokenizer_path)")
        glue = long[len(short):]
        if sampled_end and glue.startswith(sampled_end):
            glue = glue[len(sampled_end):]
        return glue

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def glue_ids(self, history: list[dict], turn_text: str, tool_messages: list[dict], sampled_end: str = "") -> list[int]:
        return self.encode(self.glue_text(history, turn_text, tool_messages, sampled_end))

    def probe(self) -> None:
        """Refuse (ConfigError) a template that is not prefix-preserving on a three-turn tool conversation with
        reasoning in every assistant turn, or that cannot render tool messages."""
        history = [{"role": "user", "content": "probe"}]
        try:
            for k, turn in enumerate(_PROBE_TURNS):
                last = k == len(_PROBE_TURNS) - 1
                tools = [] if last else [tool_message("1", "probe")]
                short = self.render(history, True) + turn
                long = self.render([*history, assistant(turn), *tools], not last)
                if not long.startswith(short):
                    raise ConfigError(
                        f"multi_turn.enable: the chat template of {self.name} is not prefix-preserving: assistant turn "
                        f"{k + 1} of a tool conversation renders differently (at character "
                        f"{_first_difference(short, long)}) once later messages follow (e.g. it strips the "
                        "reasoning of earlier turns); point model.tokenizer_path at a tokenizer whose template writes "
                        "every turn unchanged")
                history += [assistant(turn), *tools]
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(f"multi_turn.enable: the chat template of {self.name} cannot render a tool conversation "
                              f"({type(e).__name__}: {' '.join(str(e).split())}); use a template with tool messages "
                              "(model.tokenizer_path)") from e


def _first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
