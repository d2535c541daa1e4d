"""Turning a row of a source into what a tokenizer takes: messages, or plain text.

Each format checks what it reads (columns present, types, roles, text that is text) and raises
:class:`BadRowError` with the reason; the dataset builder adds the file and row and either stops or skips the row.
"""

import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from toolkit.errors import UserError

# Role names as OpenAI's messages spell them, which are the tokenizers' names too.
ROLES: tuple[str, ...] = ("system", "user", "assistant")
# ShareGPT's ``from`` values; "user" and "assistant" appear in some exports as well.
SHAREGPT_ROLES: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}


class BadRowError(Exception):
    """A row that cannot become a sample; the message says why, the caller adds where."""


def check_column_map(column_map: dict[str, str] | None, allowed: set[str], *, builder: str) -> dict[str, str]:
    """Validates a ``column_map`` (our name -> the file's column name) so that a typo fails at once.

    Raises:
        UserError: on a column_map that is not a mapping, a key the builder does not read, or a non-string
            column name.
    """
    if column_map is not None and not isinstance(column_map, Mapping):
        raise UserError(
            f"{builder}: column_map must map names to the file's column names, e.g. {{input: question}}; got "
            f"{column_map!r}"
        )
    column_map = dict(column_map or {})
    unknown = sorted(set(column_map) - allowed)
    if unknown:
        raise UserError(
            f"{builder}: column_map key(s) {', '.join(map(repr, unknown))} are not read; it maps "
            f"{', '.join(sorted(allowed))} to the file's column names"
        )
    for key, value in column_map.items():
        if not isinstance(value, str):
            raise UserError(f"{builder}: column_map[{key!r}] must be a column name, got {value!r}")
    return column_map


def _check_text_option(value: object, name: str) -> None:
    """Refuse a text option (``system_prompt``, ``prompt_template``) that is not a string or cannot be encoded.

    Raises:
        UserError: naming the option.
    """
    if value is not None and not isinstance(value, str):
        raise UserError(f"{name} must be a string, got {_type_name(value)} {value!r}")
    if value is not None and (problem := _not_text(value)):
        raise UserError(f"{name} {problem}")


def column(row: Any, name: str, *, mapped_from: str | None = None) -> Any:
    """``row[name]``, or a :class:`BadRowError` saying which columns the row does have.

    Args:
        row: the row.
        name: the file's column name.
        mapped_from: the builder's name for the column when ``column_map`` renamed it, for the message.
    """
    if not isinstance(row, dict):
        kind = "null" if row is None else f"{'an' if type(row).__name__[0] in 'aeiou' else 'a'} {type(row).__name__}"
        raise BadRowError(f"expected an object with named columns, got {kind}")
    if name not in row:
        via = f" named by column_map[{mapped_from!r}]" if mapped_from is not None and mapped_from != name else ""
        raise BadRowError(f"missing column {name!r}{via} (the row has: {', '.join(map(str, row)) or 'none'})")
    return row[name]


def text_column(row: Any, name: str, *, mapped_from: str | None = None) -> str:
    """``row[name]``, which must be a string that is valid text (see :func:`column` for the arguments)."""
    value = column(row, name, mapped_from=mapped_from)
    if not isinstance(value, str):
        raise BadRowError(f"column {name!r} must be a string, got {_type_name(value)}")
    if problem := _not_text(value):
        raise BadRowError(f"column {name!r} {problem}")
    return value


def _not_text(value: str) -> str | None:
    """Why ``value`` cannot be tokenized, or None.

    JSON's ``\\ud800`` escapes can spell half of a UTF-16 surrogate pair, which ``json.loads`` accepts but which
    is no character: UTF-8 cannot encode it, so every tokenizer would fail on it.
    """
    if value.isascii():  # O(1) in CPython, and true of most text
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"has a lone UTF-16 surrogate {value[e.start]!r} at character {e.start + 1}, which is not text (half of "
            "a character pair, as a JSON \\u escape can write it)"
        )
    return None


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _content(message: dict, key: str, index: int) -> str:
    content = message[key]
    # OpenAI's content may be a list of parts; text parts are all a text model can take.
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise BadRowError(f"message {index} has a content part that is not text: {part!r:.80}")
            if problem := _not_text(part["text"]):
                raise BadRowError(f"message {index}'s {key!r} {problem}")
            texts.append(part["text"])
        return "".join(texts)
    if not isinstance(content, str):
        raise BadRowError(f"message {index}'s {key!r} must be a string, got {_type_name(content)}")
    if problem := _not_text(content):
        raise BadRowError(f"message {index}'s {key!r} {problem}")
    return content


def normalize_messages(value: Any, *, name: str) -> list[dict[str, str]]:
    """OpenAI (``role``/``content``, optional ``reasoning_content``) or ShareGPT (``from``/``value``) messages as
    ``{"role", "content"}`` dicts (plus ``reasoning_content`` where given).

    Args:
        value: the column's value.
        name: the column's name, for messages.

    Raises:
        BadRowError: not a list, empty, a message that is not a dict or has neither key pair, an unknown role.
    """
    if not isinstance(value, list):
        raise BadRowError(f"column {name!r} must be a list of messages, got {_type_name(value)}")
    if not value:
        raise BadRowError(f"empty conversation in column {name!r}")
    messages = []
    for index, message in enumerate(value, 1):
        if isinstance(message, dict) and "role" in message and "content" in message:
            role = message["role"]
            if not isinstance(role, str) or role not in ROLES:
                raise BadRowError(f"message {index} has unknown role {role!r} (known: {', '.join(ROLES)})")
            normalized = {"role": role, "content": _content(message, "content", index)}
            reasoning = message.get("reasoning_content")
            if reasoning is not None:  # a reasoning model's thinking (Qwen3's template places it in <think>)
                if not isinstance(reasoning, str):
                    raise BadRowError(f"message {index}: 'reasoning_content' must be text, got {_type_name(reasoning)}")
                if problem := _not_text(reasoning):
                    raise BadRowError(f"message {index}'s 'reasoning_content' {problem}")
                normalized["reasoning_content"] = reasoning
            messages.append(normalized)
        elif isinstance(message, dict) and "from" in message and "value" in message:
            role = message["from"]
            if not isinstance(role, str) or role not in SHAREGPT_ROLES:
                raise BadRowError(
                    f"message {index} has unknown role {role!r} (known: {', '.join(SHAREGPT_ROLES)})"
                )
            messages.append({"role": SHAREGPT_ROLES[role], "content": _content(message, "value", index)})
        else:
            raise BadRowError(
                f"message {index} must be an object with 'role' and 'content' (OpenAI) or 'from' and 'value' "
                f"(ShareGPT), got {message!r:.80}"
            )
    return messages


def _with_system(messages: list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    if system_prompt is None or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system_prompt}] + messages


@dataclass(frozen=True)
class InstructFormat:
    """A prompt column (or several, through a template) and a response column, as a two-turn conversation.

    Attributes:
        column_map: our names (``input``, ``output``, ``system``, and any template field) to the file's.
        prompt_template: ``str.format`` template of the user turn; its fields are columns, e.g.
            ``"{instruction}\\n\\n{input}"``.
        system_prompt: a fixed system message, unless a ``system`` column is mapped.
    """

    column_map: dict[str, str]
    prompt_template: str
    system_prompt: str | None
    fields: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        _check_text_option(self.system_prompt, "system_prompt")
        fields = tuple(template_fields(self.prompt_template))
        if not fields:
            raise UserError(f"prompt_template {self.prompt_template!r} names no column; use e.g. '{{input}}'")
        object.__setattr__(self, "fields", fields)  # parsed once, not per row

    def messages(self, row: Any) -> list[dict[str, str]]:
        """The row as ``[system?, user, assistant]`` messages."""
        values = {f: self._text(row, f) for f in self.fields}
        messages = [
            {"role": "user", "content": self.prompt_template.format(**values)},
            {"role": "assistant", "content": self._text(row, "output")},
        ]
        if "system" in self.column_map:
            return [{"role": "system", "content": self._text(row, "system")}] + messages
        return _with_system(messages, self.system_prompt)

    def _text(self, row: Any, key: str) -> str:
        return text_column(row, self.column_map.get(key, key), mapped_from=key)


def template_fields(template: str) -> list[str]:
    """The column names a prompt template reads, in order.

    Raises:
        UserError: on a template that is not a string, a malformed one, or a positional or indexed field.
    """
    _check_text_option(template, "prompt_template")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise UserError(f"prompt_template {template!r} is not a valid format string: {e}") from None
    fields = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise UserError(f"prompt_template fields must be column names like {{input}}; got {{{name}}}")
        if name not in fields:
            fields.append(name)
    return fields


@dataclass(frozen=True)
class ChatFormat:
    """A column of OpenAI or ShareGPT messages.

    Attributes:
        column: the messages column; ``None`` takes ``messages``, else ``conversations`` (ShareGPT's name).
        system_prompt: prepended as a system message to conversations that do not start with one.
    """

    column: str | None
    system_prompt: str | None

    def __post_init__(self) -> None:
        _check_text_option(self.system_prompt, "system_prompt")

    def messages(self, row: Any) -> list[dict[str, str]]:
        """The row's conversation as ``{"role", "content"}`` messages."""
        name = self.column
        if name is None:
            sharegpt = isinstance(row, dict) and "messages" not in row and "conversations" in row
            name = "conversations" if sharegpt else "messages"
        value = column(row, name, mapped_from="messages" if self.column is not None else None)
        return _with_system(normalize_messages(value, name=name), self.system_prompt)


@dataclass(frozen=True)
class TextFormat:
    """One document per row, in a text column."""

    column: str

    def text(self, row: Any) -> str:
        """The document."""
        text = text_column(row, self.column, mapped_from="text")
        if not text:
            raise BadRowError(f"column {self.column!r} is empty")
        return text


@dataclass(frozen=True)
class PreferenceFormat:
    """A prompt with a chosen and a rejected response.

    ``chosen``/``rejected`` are either response strings (then the ``prompt`` column, a string or a list of
    messages, comes first) or whole conversations as lists of messages (then ``prompt`` is not read).

    Attributes:
        column_map: our names (``prompt``, ``chosen``, ``rejected``) to the file's.
        system_prompt: prepended to conversations that do not start with a system message.
    """

    column_map: dict[str, str]
    system_prompt: str | None

    def __post_init__(self) -> None:
        _check_text_option(self.system_prompt, "system_prompt")

    def pair(self, row: Any) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
        """``(chosen, rejected)`` conversations."""
        chosen, rejected = (self._conversation(row, key) for key in ("chosen", "rejected"))
        if chosen == rejected:  # a pair that prefers nothing: its loss is a constant, and a data error
            names = (self.column_map.get(key, key) for key in ("chosen", "rejected"))
            raise BadRowError("columns {!r} and {!r} are the same; a preference pair needs two answers".format(*names))
        return chosen, rejected

    def _conversation(self, row: Any, key: str) -> list[dict[str, str]]:
        name = self.column_map.get(key, key)
        value = column(row, name, mapped_from=key)
        if isinstance(value, list):
            messages = normalize_messages(value, name=name)
        elif isinstance(value, str):
            if problem := _not_text(value):
                raise BadRowError(f"column {name!r} {problem}")
            messages = self._prompt(row) + [{"role": "assistant", "content": value}]
        else:
            raise BadRowError(f"column {name!r} must be a string or a list of messages, got {_type_name(value)}")
        return _with_system(_answered(messages, name), self.system_prompt)

    def _prompt(self, row: Any) -> list[dict[str, str]]:
        name = self.column_map.get("prompt", "prompt")
        value = column(row, name, mapped_from="prompt")
        if isinstance(value, str):
            if problem := _not_text(value):
                raise BadRowError(f"column {name!r} {problem}")
            return [{"role": "user", "content": value}]
        if not isinstance(value, list):
            raise BadRowError(f"column {name!r} must be a string or a list of messages, got {_type_name(value)}")
        return normalize_messages(value, name=name)


def _answered(messages: list[dict[str, str]], name: str) -> list[dict[str, str]]:
    """``messages``, whose last one is a judged answer (a preference pair's side, a KTO completion). An empty one
    (or only whitespace) gives the loss nothing to judge but the end-of-turn token: the row is refused, not trained
    on in silence."""
    last = messages[-1]
    if last["role"] == "assistant" and not (last["content"].strip() or last.get("reasoning_content", "").strip()):
        raise BadRowError(f"column {name!r} has an empty answer; a judged answer needs text")
    return messages


@dataclass(frozen=True)
class UnpairedFormat(PreferenceFormat):
    """Answers judged one at a time, desirable or not (KTO's data): a ``prompt`` with a ``completion`` and its
    ``label`` (true: desirable), or a preference pair (``chosen`` and ``rejected``, as :class:`PreferenceFormat`
    reads them), which gives two rows: the chosen answer desirable, the rejected one not.

    A ``completion`` is a response string or a list of messages: messages that start with the assistant's are the
    answer to the ``prompt``; any other list is a whole conversation. ``label`` is a boolean, or ``0``/``1``, or
    ``"true"``/``"false"`` (CSV).

    Attributes:
        column_map: our names (``prompt``, ``completion``, ``label``, ``chosen``, ``rejected``) to the file's.
        system_prompt: prepended to conversations that do not start with a system message.
    """

    def rows(self, row: Any) -> list[tuple[list[dict[str, str]], bool]]:
        """``[(conversation, desirable)]``: one for an unpaired row, two for a pair."""
        if isinstance(row, dict) and self.column_map.get("completion", "completion") not in row and all(
            self.column_map.get(key, key) in row for key in ("chosen", "rejected")
        ):
            chosen, rejected = self.pair(row)
            return [(chosen, True), (rejected, False)]
        return [(self._completion(row), self._label(row))]

    def _completion(self, row: Any) -> list[dict[str, str]]:
        name = self.column_map.get("completion", "completion")
        value = column(row, name, mapped_from="completion")
        if isinstance(value, list) and value and isinstance(value[0], dict) and value[0].get("role") == "assistant":
            answer = _answered(normalize_messages(value, name=name), name)
            return _with_system(self._prompt(row) + answer, self.system_prompt)
        return self._conversation(row, "completion")

    def _label(self, row: Any) -> bool:
        name = self.column_map.get("label", "label")
        value = column(row, name, mapped_from="label")
        if isinstance(value, bool):
            return value
        if type(value) is int and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise BadRowError(f"column {name!r} must be true (a desirable answer) or false, got {_type_name(value)} "
                          f"{value!r:.40}")


@dataclass(frozen=True)
class PromptFormat:
    """A prompt to answer, for online RL: a string (one user message) or messages ending with the user's turn; the
    row's other columns are its fields (what rewards compare with, an ``answer``).

    Attributes:
        column: the prompt's column.
        system_prompt: prepended as a system message to prompts that do not start with one.
    """

    column: str
    system_prompt: str | None

    def __post_init__(self) -> None:
        _check_text_option(self.system_prompt, "system_prompt")
        if not isinstance(self.column, str) or not self.column:
            raise UserError(f"prompt_column must be a column name, got {self.column!r}")

    def messages(self, row: Any) -> list[dict[str, str]]:
        """The conversation the model answers next, ending with the user's message."""
        value = column(row, self.column)
        if isinstance(value, str):
            if problem := _not_text(value):
                raise BadRowError(f"column {self.column!r} {problem}")
            messages = [{"role": "user", "content": value}]
        elif isinstance(value, list):
            messages = normalize_messages(value, name=self.column)
            if messages[-1]["role"] != "user":
                raise BadRowError(
                    f"column {self.column!r} must end with a user message (the prompt to answer); its last message "
                    f"is the {messages[-1]['role']}'s"
                )
        else:
            raise BadRowError(f"column {self.column!r} must be a string or a list of messages, got {_type_name(value)}")
        if not messages[-1]["content"].strip():
            raise BadRowError(f"column {self.column!r} has an empty prompt")
        return _with_system(messages, self.system_prompt)

    def fields(self, row: dict[str, Any]) -> dict[str, Any]:
        """The row's columns other than the prompt."""
        return {key: value for key, value in row.items() if key != self.column}
