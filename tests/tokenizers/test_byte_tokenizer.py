import pytest
import torch

from toolkit.errors import UserError
from toolkit.tokenizers import ByteTokenizer, byte_tokenizer


def _conversation() -> list[dict]:
    return [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye?"},
        {"role": "assistant", "content": "ciao"},
    ]


def _text(tok: ByteTokenizer, ids: list[int], mask: list[bool]) -> str:
    """The trained tokens, specials spelled out, so expectations read as text."""
    return tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "plain ascii",
        "tabs\t\tand   spaces \n\n\r\n",
        "  ",
        "naïve café Ελληνικά 日本語",
        "emoji 🦙🔥👩‍👩‍👧 end",
    ],
)
def test_round_trip(text: str) -> None:
    tok = byte_tokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert ids[1:-1] == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_bos=False, add_eos=False)) == text
    assert tok.decode(torch.tensor(ids)) == text


def test_special_ids() -> None:
    tok = byte_tokenizer()
    specials = [tok.bos_id, tok.eos_id, tok.pad_id, tok.start_header_id, tok.end_header_id, tok.eot_id]
    assert specials == list(range(256, 262))
    assert tok.vocab_size == 262
    assert tok.stop_tokens == [tok.eot_id, tok.eos_id]
    assert tok.encode("a", add_bos=False, add_eos=False) == [97]
    # Special-token text in user input stays bytes.
    assert tok.encode("<|eot|>", add_bos=False, add_eos=False) == list(b"<|eot|>")


def test_decode_never_raises() -> None:
    tok = byte_tokenizer()
    snowman = list("☃".encode("utf-8"))
    assert tok.decode(snowman[:2]) == "\ufffd"
    assert tok.decode([104, 105, 10_000, -1]) == "hi\ufffd\ufffd"
    # A special token between bytes splits them; it is dropped or spelled out.
    assert tok.decode([snowman[0], tok.eot_id, 104]) == "\ufffdh"
    assert tok.decode([104, tok.eot_id, 105], skip_special_tokens=False) == "h<|eot|>i"


def test_mask_assistant() -> None:
    tok = byte_tokenizer()
    ids, mask = tok.tokenize_messages(_conversation())
    assert len(ids) == len(mask)
    assert tok.decode(ids, skip_special_tokens=False) == (
        "<|begin_of_text|>"
        "<|start_header|>system<|end_header|>be brief<|eot|>"
        "<|start_header|>user<|end_header|>hi<|eot|>"
        "<|start_header|>assistant<|end_header|>hello<|eot|>"
        "<|start_header|>user<|end_header|>bye?<|eot|>"
        "<|start_header|>assistant<|end_header|>ciao<|eot|>"
        "<|end_of_text|>"
    )
    # Only assistant contents, their eot, and the final eos; never a header.
    assert _text(tok, ids, mask) == "hello<|eot|>ciao<|eot|><|end_of_text|>"
    assert not any(mask[i] for i, t in enumerate(ids) if t in (tok.start_header_id, tok.end_header_id))


def test_mask_last_turn_and_all() -> None:
    tok = byte_tokenizer()
    ids, mask = tok.tokenize_messages(_conversation(), train_on="last_turn")
    assert _text(tok, ids, mask) == "ciao<|eot|><|end_of_text|>"
    ids, mask = tok.tokenize_messages(_conversation(), train_on="all")
    assert mask == [False] + [True] * (len(ids) - 1)


def test_mask_eos_follows_last_message() -> None:
    tok = byte_tokenizer()
    messages = [{"role": "user", "content": "q"}]
    ids, mask = tok.tokenize_messages(messages)
    assert ids[-1] == tok.eos_id and not any(mask)
    ids, mask = tok.tokenize_messages(messages + [{"role": "assistant", "content": "a"}], add_eos=False)
    assert ids[-1] == tok.eot_id and _text(tok, ids, mask) == "a<|eot|>"


def test_truncation() -> None:
    tok = byte_tokenizer(max_seq_len=5)
    assert tok.encode("abcdefgh") == [tok.bos_id] + list(b"abcd")
    full_ids, full_mask = byte_tokenizer().tokenize_messages(_conversation())
    ids, mask = tok.tokenize_messages(_conversation())
    assert (ids, mask) == (full_ids[:5], full_mask[:5])
    # Prompts are never cut: the assistant header must stay.
    assert len(tok.prompt_tokens(_conversation())) > 5


def test_prompt_tokens() -> None:
    tok = byte_tokenizer()
    messages = _conversation()[:4]
    prompt = tok.prompt_tokens(messages)
    header = [tok.start_header_id] + list(b"assistant") + [tok.end_header_id]
    assert prompt[-len(header) :] == header
    ids, _ = tok.tokenize_messages(messages, add_eos=False)
    assert prompt == ids + header


def test_bad_input() -> None:
    tok = byte_tokenizer()
    with pytest.raises(UserError, match="assistant, last_turn, all"):
        tok.tokenize_messages(_conversation(), train_on="everything")
    with pytest.raises(UserError, match="system, user, assistant"):
        tok.tokenize_messages([{"role": "bot", "content": "x"}])
    with pytest.raises(UserError, match="'role' and 'content'"):
        tok.tokenize_messages([{"role": "user"}])
    with pytest.raises(UserError, match="max_seq_len"):
        byte_tokenizer(max_seq_len=0)
