"""The chat formats of the model families, as sequences of segments a tokenizer turns into ids and a mask.

A format lays a conversation out as :class:`Segment` s: special tokens (inserted by id, so message text can never
produce one) and text. Each segment belongs either to a message's body (its content and the token that closes
it, trained on when that message is) or to the scaffolding around it (headers, role names, separators), which
is context. Text segments next to each other are encoded together, exactly as the reference tokenizers encode
the rendered template, and :func:`layout` recovers which tokens came from which segment.

Formats (each matches the tool-free path of its model's published template):

* :class:`Llama3ChatFormat`: ``<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>``; with ``dated=True``
  Llama 3.1/3.2/3.3's, which always opens with a system turn stating the knowledge cutoff and a date.
* :class:`Llama2ChatFormat`: ``<s>[INST] <<SYS>>...<</SYS>> user [/INST] answer </s>`` per exchange.
* :class:`MistralChatFormat`: ``<s>[INST] user[/INST] answer</s>`` with ``[INST]``/``[/INST]`` control tokens; with
  ``control_tokens=False``, ``<s>[INST] user [/INST]answer</s>`` as text (Mistral's first vocabulary: Mistral 7B
  v0.1/v0.2, Mixtral 8x7B Instruct v0.1).
* :class:`ChatMLFormat`: ``<|im_start|>role\\ncontent<|im_end|>\\n`` (Qwen2.5).
* :class:`Qwen3ChatFormat`: ChatML with Qwen3's ``<think>`` reasoning blocks.
* :class:`Phi4ChatFormat`: ``<|im_start|>role<|im_sep|>content<|im_end|>``, no newlines (Phi-4).
* :class:`Phi4MiniChatFormat`: ``<|role|>content<|end|>``, no newlines (Phi-4-mini).
* :class:`GemmaChatFormat`: ``<start_of_turn>user\\ncontent<end_of_turn>\\n``, the assistant called ``model``.

Messages may carry ``reasoning_content`` (a string), which only :class:`Qwen3ChatFormat` renders (the other
templates ignore it, and so do their formats).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from toolkit.errors import UserError
from toolkit.tokenizers.base import TRAIN_ON

ROLES: tuple[str, ...] = ("system", "user", "assistant")
# The date Llama 3.1's and 3.3's templates state when the caller gives none (3.2's asks the clock, which would
# make a dataset's tokens depend on the day it was tokenized).
LLAMA3_DEFAULT_DATE = "26 Jul 2024"


@dataclass(frozen=True)
class Segment:
    """A piece of a laid-out conversation.

    Attributes:
        text: the text, or the special token's string when ``special``.
        special: insert the special token ``text`` by id instead of encoding text.
        message: index of the message whose body this is, or ``None`` for scaffolding.
    """

    text: str
    special: bool = False
    message: int | None = None


class ChatFormat(Protocol):
    """Lays out messages; ``add_generation_prompt`` ends with what makes the model answer as assistant."""

    def segments(self, messages: list[dict], *, add_generation_prompt: bool) -> list[Segment]: ...


def check_messages(messages: list[dict]) -> None:
    """Raise :class:`UserError` unless every message is ``{"role": system|user|assistant, "content": str}``,
    optionally with ``"reasoning_content": str | None``."""
    for message in messages:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise UserError(f"each message must be a dict with 'role' and 'content'; got {message!r}")
        if message["role"] not in ROLES:
            raise UserError(f"message role must be one of {', '.join(ROLES)}; got {message['role']!r}")
        for key in ("content", "reasoning_content"):
            value = message.get(key)
            if not isinstance(value, str) and (key == "content" or value is not None):
                raise UserError(f"message {key} must be a string; got {type(value).__name__}")


def _split_system(messages: list[dict]) -> tuple[str | None, list[tuple[int, dict]]]:
    # Formats without a system turn fold a leading system message into a user turn.
    if messages and messages[0]["role"] == "system":
        return messages[0]["content"], list(enumerate(messages))[1:]
    return None, list(enumerate(messages))


def _check_alternation(turns: list[tuple[int, dict]], family: str) -> None:
    # Numbered as the user counts the messages of the row: from 1, the system message included.
    for position, (index, message) in enumerate(turns):
        expected = "user" if position % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise UserError(
                f"{family} chat format needs an optional system message, then user and assistant turns in "
                f"alternation starting with user; message {index + 1} is {message['role']!r}, not {expected!r}"
            )


class Llama3ChatFormat:
    """Llama 3's header format (content stripped of surrounding whitespace, as in the published templates).

    Llama 3.0's template renders the messages as they come. Llama 3.1's, 3.2's and 3.3's (``dated``) always open
    with a system turn: ``Cutting Knowledge Date: December 2023\\nToday Date: <date>\\n\\n`` followed by the
    conversation's system message, if it starts with one (stripped), else nothing.

    Args:
        bos: the begin-of-text token.
        dated: render Llama 3.1+'s system turn.
        date_string: the date it states (the template's ``date_string``).
    """

    def __init__(
        self, bos: str = "<|begin_of_text|>", *, dated: bool = False, date_string: str = LLAMA3_DEFAULT_DATE
    ) -> None:
        self.bos = bos
        self.dated = dated
        self.date_string = date_string

    def _header(self, role: str) -> list[Segment]:
        return [
            Segment("<|start_header_id|>", special=True), Segment(role), Segment("<|end_header_id|>", special=True),
            Segment("\n\n"),
        ]

    def _turn(self, role: str, body: list[Segment], message: int | None) -> list[Segment]:
        return self._header(role) + body + [Segment("<|eot_id|>", special=True, message=message)]

    def segments(self, messages: list[dict], *, add_generation_prompt: bool) -> list[Segment]:
        out = [Segment(self.bos, special=True)]
        turns = list(enumerate(messages))
        if self.dated:
            system, turns = _split_system(messages)
            preamble = Segment(f"Cutting Knowledge Date: December 2023\nToday Date: {self.date_string}\n\n")
            owner = 0 if system is not None else None
            out += self._turn("system", [preamble, Segment((system or "").strip(), message=owner)], owner)
        for i, message in turns:
            out += self._turn(message["role"], [Segment(message["content"].strip(), message=i)], i)
        if add_generation_prompt:
            out += self._header("assistant")
        return out


def _chatml_turn(role: str, body: list[Segment], message: int | None) -> list[Segment]:
    return [
        Segment("<|im_start|>", special=True), Segment(role + "\n"), *body,
        Segment("<|im_end|>", special=True, message=message), Segment("\n"),
    ]


_CHATML_PROMPT = [Segment("<|im_start|>", special=True), Segment("assistant\n")]


class ChatMLFormat:
    """ChatML as Qwen2.5 uses it.

    Args:
        default_system_prompt: system message inserted when the conversation has none (Qwen2.5's template
            inserts one).
    """

    def __init__(self, default_system_prompt: str | None = None) -> None:
        self.default_system_prompt = default_system_prompt

    def segments(self, messages: list[dict], *, add_generation_prompt: bool) -> list[Segment]:
        out: list[Segment] = []
        if self.default_system_prompt is not None and (not messages or messages[0]["role"] != "system"):
            out += _chatml_turn("system", [Segment(self.default_system_prompt)], None)
        for i, message in enumerate(messages):
            out += _chatml_turn(message["role"], [Segment(message["content"], message=i)], i)
        return out + (_CHATML_PROMPT if add_generation_prompt else [])


def _reasoning(message: dict) -> tuple[str, str]:
    # Qwen3's template: reasoning_content when it is a string, else what content holds between <think> and
    # </think>, which then leave content.
    content = message["content"]
    if isinstance(message.get("reasoning_content"), str):
        return message["reasoning_content"], content
    if "</think>" not in content:
        return "", content
    before, *_, after = content.split("</think>")
    return before.rstrip("\n").split("<think>")[-1].lstrip("\n"), after.lstrip("\n")


class Qwen3ChatFormat:
    """Qwen3's ChatML with reasoning (the template of the hybrid thinking Qwen3 models, tool-free path).

    Only assistant turns after the last user query keep their reasoning, written before the answer as
    ``<think>\\nreasoning\\n</think>\\n\\n``; the conversation's last message, when it is such a turn, gets
    the block even with no reasoning (then empty). Earlier assistant turns are history, shown as the bare answer.

    Trained (``train_on: assistant``): what the model writes after ``<|im_start|>assistant\\n``, i.e. the turns
    after the last user query, think block included. History turns are context: the template strips their
    reasoning, a form the model never produces, and training on them would teach it to skip its thinking.
    With ``enable_thinking=False`` an empty think block is part of the prompt, so it is context too.

    Args:
        enable_thinking: ``False`` ends the generation prompt with an empty think block (the template's
            ``enable_thinking=False``), so the model answers without reasoning.
    """

    def __init__(self, enable_thinking: bool = True) -> None:
        self.enable_thinking = enable_thinking

    def segments(self, messages: list[dict], *, add_generation_prompt: bool) -> list[Segment]:
        # A user message that only wraps a tool response is not a query (the template's multi-step tool rule).
        queries = [
            i for i, m in enumerate(messages) if m["role"] == "user"
            and not (m["content"].startswith("<tool_response>") and m["content"].endswith("</tool_response>"))
        ]
        last_query = queries[-1] if queries else len(messages) - 1
        out: list[Segment] = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                out += _chatml_turn(message["role"], [Segment(message["content"], message=i)], i)
                continue
            reasoning, content = _reasoning(message)
            owner = i if i > last_query else None
            body = []
            if i > last_query and (i == len(messages) - 1 or reasoning):
                reasoning = reasoning.strip("\n")
                trained = self.enable_thinking or bool(reasoning)
                body.append(Segment(f"<think>\n{reasoning}\n</think>\n\n", message=owner if trained else None))
                content = content.lstrip("\n")
            out += _chatml_turn("assistant", body + [Segment(content, message=owner)], owner)
        if add_generation_prompt:
            out += _CHATML_PROMPT + ([] if self.enable_thinking else [Segment("<think>\n\n</think>\n\n")])
        return out


class Phi4ChatFormat:
    """Phi-4's chat format: ChatML's turns with the role closed by ``<|im_sep|>`` instead of a newline, and nothing
    between turns. No default system prompt; the messages are rendered as they come, their content as is."""

    @staticmethod
    def _header(role: str) -> list[Segment]:
        return [Segment("<|im_start|>", special=True), Segment(role), Segment("<|im_sep|>", special=True)]

    def segments(self, messages: list[dict], *, add_generation_prompt: bool) -> list[Segment]:
        out: list[Segment] = []
        for i, message in enumerate(messages):
            out += self._header(message["role"]) + [
                Segment(message["content"], message=i), Segment("<|im_end|>", special=True, message=i),
            ]
        return out + (self._header("assistant") if add_generation_prompt else [])


class Phi4MiniChatFormat:
    """Phi-4-mini's chat format (Phi-4-mini-instruct, Phi-4-mini-reasoning): each message as its role's special token
    (``<|system|>``, ``<|user|>``, ``<|assistant|>``), its content as is and ``<|end|>``, nothing between messages,
    and ``<|assistant|>`` to prompt an answer. No default system prompt. Where the template ends a conversation that
    prompts for nothing with the eos token (``<|endoftext|>``), ``tokenize_messages(add_eos=True)`` appends it."""

    def segments(self, messages: list[dict], *, add_generation_prompt: bool) -> list[Segment]:
        out: list[Segment] = []
        for i, message in enumerate(messages):
            out += [
                Segment(f"<|{message['role']}|>", special=True), Segment(message["content"], message=i),
                Segment("<|end|>", special=True, message=i),
            ]
        return out + ([Segment("<|assistant|>", special=True)] if add_generation_prompt else [])


class Llama2ChatFormat:
    """Llama 2 chat, as Meta's reference ``chat_completion`` encodes it: each user/assistant exchange is its own
    ``<s>...</s>`` sequence, the system prompt wrapped in ``<<SYS>>`` inside the first user turn."""

    def segments(self, messages: list[dict], *, add_generation_prompt: bool) -> list[Segment]:
        system, turns = _split_system(messages)
        _check_alternation(turns, "Llama 2")
        out: list[Segment] = []
        for position, (i, message) in enumerate(turns):
            content = message["content"].strip()
            if message["role"] == "user":
                if position == 0 and system is not None:
                    content = f"<<SYS>>\n{system.strip()}\n<</SYS>>\n\n{content}"
                out += [Segment("<s>", special=True), Segment(f"[INST] {content} [/INST]")]
            else:
                out += [Segment(f" {content} ", message=i), Segment("</s>", special=True, message=i)]
        return out


class MistralChatFormat:
    """Mistral's instruct format. With ``control_tokens`` (tokenizer v3: Mistral 7B v0.3, Mixtral 8x22B), ``[INST]``
    and ``[/INST]`` are control tokens around each stripped user message. Without (the first vocabulary, where they
    are text: Mistral 7B v0.1/v0.2, Mixtral 8x7B Instruct v0.1), each user message is the text ``[INST] {content}
    [/INST]``, encoded with the answer that follows it, and messages are not stripped, as that template writes them.
    The system prompt goes before the last user message, as in Mistral's v3 template (the first template has no system
    role; this is where the later one puts it)."""

    def __init__(self, control_tokens: bool = True) -> None:
        self.control_tokens = control_tokens

    def segments(self, messages: list[dict], *, add_generation_prompt: bool) -> list[Segment]:
        system, turns = _split_system(messages)
        _check_alternation(turns, "Mistral")
        last_user = max((p for p, (_, m) in enumerate(turns) if m["role"] == "user"), default=-1)
        out = [Segment("<s>", special=True)]
        for position, (i, message) in enumerate(turns):
            content = message["content"].strip() if self.control_tokens else message["content"]
            if message["role"] == "user":
                if position == last_user and system is not None:
                    content = f"{system.strip()}\n\n{content}"
                if self.control_tokens:
                    out += [Segment("[INST]", special=True), Segment(content), Segment("[/INST]", special=True)]
                else:
                    out.append(Segment(f"[INST] {content} [/INST]"))
            else:
                out += [Segment(content, message=i), Segment("</s>", special=True, message=i)]
        return out


class GemmaChatFormat:
    """Gemma's turns (Gemma 2 and 3); Gemma has no system role, so a system message is prepended to the first user
    turn, untrimmed and followed by a blank line, as Gemma 3's template does (Gemma 2's refuses system messages)."""

    def segments(self, messages: list[dict], *, add_generation_prompt: bool) -> list[Segment]:
        system, turns = _split_system(messages)
        out = [Segment("<bos>", special=True)]
        for position, (i, message) in enumerate(turns):
            content = message["content"].strip()
            if position == 0 and system is not None and message["role"] == "user":
                content = f"{system}\n\n{content}"
            role = "model" if message["role"] == "assistant" else message["role"]
            out += [
                Segment("<start_of_turn>", special=True),
                Segment(role + "\n"),
                Segment(content, message=i),
                Segment("<end_of_turn>", special=True, message=i),
                Segment("\n"),
            ]
        if add_generation_prompt:
            out += [Segment("<start_of_turn>", special=True), Segment("model\n")]
        return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _encode_run(run: list[Segment], encode: Callable[[str], list[int]]) -> tuple[list[int], list[int | None]]:
    # The run is encoded as one text, as the reference tokenizer sees it. A token that starts in one segment
    # and ends in the next (a merge across the boundary) is credited to the later segment.
    ids = encode("".join(s.text for s in run))
    owners: list[int | None] = [run[-1].message] * len(ids)
    start = 0
    for k in range(1, len(run)):
        end = _common_prefix(encode("".join(s.text for s in run[:k])), ids)
        for t in range(start, end):
            owners[t] = run[k - 1].message
        start = max(start, end)
    return ids, owners


def layout(
    messages: list[dict],
    chat_format: ChatFormat,
    *,
    encode: Callable[[str], list[int]],
    special_id: Callable[[str], int],
    train_on: str,
    add_generation_prompt: bool = False,
) -> tuple[list[int], list[bool]]:
    """Tokens and training mask of a conversation.

    Args:
        messages: ``{"role", "content"}`` dicts, optionally with ``reasoning_content``.
        chat_format: the family's format.
        encode: text to ids (no special tokens).
        special_id: a special token's id.
        train_on: ``assistant`` (bodies of assistant messages), ``last_turn`` (that of the last one) or ``all``
            (every token but the first).
        add_generation_prompt: end with the prompt for an assistant answer.

    Raises:
        UserError: a malformed message, an unknown ``train_on``, or turns the format cannot express.
    """
    if train_on not in TRAIN_ON:
        raise UserError(f"train_on must be one of {', '.join(TRAIN_ON)}; got {train_on!r}")
    check_messages(messages)
    last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)

    def trained(owner: int | None) -> bool:
        if owner is None:
            return False
        return messages[owner]["role"] == "assistant" and (train_on == "assistant" or owner == last_assistant)

    tokens: list[int] = []
    owners: list[int | None] = []
    run: list[Segment] = []
    for segment in chat_format.segments(messages, add_generation_prompt=add_generation_prompt) + [Segment("", True)]:
        if not segment.special:
            if segment.text:
                run.append(segment)
            continue
        if run:
            ids, run_owners = _encode_run(run, encode)
            tokens += ids
            owners += run_owners
            run = []
        if segment.text:
            tokens.append(special_id(segment.text))
            owners.append(segment.message)
    if train_on == "all":
        return tokens, [i > 0 for i in range(len(tokens))]
    return tokens, [trained(owner) for owner in owners]
