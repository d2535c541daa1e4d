"""A tokenizer's chat format as text, for harnesses that build prompts as strings (lm-evaluation-harness's
``apply_chat_template``).

Our tokenizers lay conversations out as token ids: special tokens are inserted by id, and text, even a special
token's string, always encodes as text, so data cannot smuggle control tokens into training. A harness instead
renders a conversation to a string and hands that string back as the context of its requests. :class:`ChatTemplate`
renders a conversation as the tokenizer's own chat encoding, decoded with its special tokens written out, and encodes
such a string back by cutting it at those tokens' strings and encoding the text between them as the chat layout
does: the ids are the training-time ones, and the format's own bos is not doubled.
"""

import hashlib
import re

from toolkit.errors import UserError

# For add_generation_prompt=False (lm-eval prefills an assistant answer with a task's gen_prefix this way, as
# transformers' continue_final_message does): the final message is rendered with this marker after its content and
# the text is cut where the marker starts, so the model continues the message.
CONTINUE_TAG = "TUNEKIT_OPEN_MESSAGE_ENDS_HERE "
# A conversation with every role: rendering it checks that the tokenizer has a chat format and meets its special
# tokens.
_PROBE = [
    {"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
    {"role": "user", "content": "u"},
]


class ChatTemplate:
    """Renders conversations in a tokenizer's chat format as strings, and encodes such strings back to its ids.

    A special token's string inside a message (``"<|eot_id|>"`` in a document) is read back as the special token,
    as Hugging Face tokenizers read a rendered template; training encodes it as text.

    Args:
        tokenizer: a :class:`~toolkit.tokenizers.ChatTokenizer` that keeps every token (``max_seq_len`` None).

    Raises:
        UserError: the tokenizer has no chat format (no ``tokenize_messages``/``prompt_tokens``, or a
            ``chat_format`` of ``None``).
    """

    def __init__(self, tokenizer) -> None:
        name = f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}"
        lays_out_chats = all(callable(getattr(tokenizer, m, None)) for m in ("tokenize_messages", "prompt_tokens"))
        if not lays_out_chats or getattr(tokenizer, "chat_format", "") is None:
            raise UserError(
                f"lm_eval.apply_chat_template needs a tokenizer with a chat template; {name} has none (it lays out "
                "no conversations); set lm_eval.apply_chat_template=false or use a tokenizer with a chat format"
            )
        self.tokenizer = tokenizer
        self._specials: dict[str, int] = {}  # special token string -> id, for every special token rendered so far
        self._looked_at: set[int] = set()
        self._pattern: re.Pattern | None = None
        probe = self.render(_PROBE)
        # For lm-eval's request cache keys: the tokenizer class, its vocabulary size and what its format writes.
        digest = hashlib.sha256(f"{probe}{tokenizer.prompt_tokens(_PROBE)}".encode()).hexdigest()[:16]
        self.name = f"{type(tokenizer).__name__}-{tokenizer.vocab_size}-{digest}"

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """The conversation as text.

        Args:
            messages: ``{"role": system|user|assistant, "content": str}`` dicts.
            add_generation_prompt: end with the prompt for an assistant answer (:meth:`encode` then gives the
                tokenizer's ``prompt_tokens``); ``False`` leaves the final message open for the model to continue
                (transformers' ``continue_final_message``): the text up to its content's end, trimmed of trailing
                whitespace when the format trims messages.

        Raises:
            UserError: a malformed message, turns the format cannot express, or a final message the format drops.
        """
        if add_generation_prompt:
            return self._text(self.tokenizer.prompt_tokens(messages))
        if not messages:
            raise UserError("a chat to continue needs a final message")
        tagged = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + CONTINUE_TAG}]
        text = self._text(self.tokenizer.tokenize_messages(tagged, add_eos=False)[0])
        end = text.rfind(CONTINUE_TAG.strip())
        if end < 0:
            role = messages[-1]["role"]
            raise UserError(f"the chat format drops the final message ({role}), so it cannot be continued")
        # A format that strips messages has stripped the tag's space: its end is then trimmed as well.
        return text[:end] if text.startswith(CONTINUE_TAG, end) else text[:end].rstrip()

    def encode(self, text: str) -> list[int]:
        """``text`` as ids: the strings of the special tokens met by :meth:`render` as those tokens, the text
        between them encoded as the chat layout encodes it, and no bos added (a rendered chat brings its own)."""
        tokens: list[int] = []
        start = 0
        for match in self._pattern.finditer(text) if self._pattern else ():
            tokens += self._encode_text(text[start : match.start()])
            tokens.append(self._specials[match.group()])
            start = match.end()
        return tokens + self._encode_text(text[start:])

    def _encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_bos=False, add_eos=False) if text else []

    def _text(self, tokens: list[int]) -> str:
        """``tokens`` decoded with their special tokens written out; each special token is remembered, for
        :meth:`encode`, the first time it is met (a token that decodes to nothing unless written out)."""
        for token in set(tokens) - self._looked_at:
            self._looked_at.add(token)
            written = self.tokenizer.decode([token], skip_special_tokens=False)
            if written and not self.tokenizer.decode([token]):
                self._specials[written] = token
                # The longest string first, where one special token's string starts another's.
                alternatives = sorted(self._specials, key=len, reverse=True)
                self._pattern = re.compile("|".join(map(re.escape, alternatives)))
        return self.tokenizer.decode(tokens, skip_special_tokens=False)
