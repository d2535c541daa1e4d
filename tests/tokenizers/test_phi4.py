"""Phi-4's and Phi-4-mini's tokenizer.json tokenizers and chat formats, on byte-level BPEs the test trains, against
hand-written expected sequences; and which phi3 folders get which."""

import pytest
from tokenizers import Tokenizer, models

from tests.tiny_tokenizer import PHI4_MINI_SPECIALS, PHI4_SPECIALS, chatml_byte_level_bpe
from toolkit.errors import UserError
from toolkit.tokenizers import (
    Phi4ChatFormat,
    Phi4MiniChatFormat,
    from_pretrained,
    phi4_mini_tokenizer,
    phi4_tokenizer,
)

SYSTEM = {"role": "system", "content": "Be brief."}
USER, ANSWER = {"role": "user", "content": "What is 2+2? ✨"}, {"role": "assistant", "content": "4"}


def phi3_folder(tmp_path_factory, corpus, special_tokens: tuple[str, ...]):
    """A model_type phi3 folder with a byte-level BPE trained on ``corpus`` around ``special_tokens``."""
    tokenizer = chatml_byte_level_bpe(corpus, vocab_size=500, special_tokens=special_tokens)
    folder = tmp_path_factory.mktemp("phi3")
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text('{"model_type": "phi3"}')
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, corpus):
    return phi3_folder(tmp_path_factory, corpus, PHI4_SPECIALS)


def test_chat_format_lays_out_the_published_turns(model_dir):
    tokenizer = from_pretrained(str(model_dir))
    assert isinstance(tokenizer.chat_format, Phi4ChatFormat)
    tokens, mask = tokenizer.tokenize_messages([SYSTEM, USER, ANSWER], add_eos=False, train_on="assistant")
    start, sep, end = (tokenizer.engine.token_to_id(t) for t in ("<|im_start|>", "<|im_sep|>", "<|im_end|>"))
    text = tokenizer.engine.encode
    # Special tokens by id (never produced by text), roles and contents as text, no newlines anywhere.
    assert tokens == [
        start, *text("system"), sep, *text("Be brief."), end,
        start, *text("user"), sep, *text("What is 2+2? ✨"), end,
        start, *text("assistant"), sep, *text("4"), end,
    ]
    assert tokenizer.decode(tokens, skip_special_tokens=False) == (
        "<|im_start|>system<|im_sep|>Be brief.<|im_end|><|im_start|>user<|im_sep|>What is 2+2? ✨<|im_end|>"
        "<|im_start|>assistant<|im_sep|>4<|im_end|>"
    )
    # Trained: the assistant's content and the <|im_end|> that closes it.
    assert mask == [False] * (len(tokens) - len(text("4")) - 1) + [True] * (len(text("4")) + 1)
    prompt = tokenizer.decode(tokenizer.prompt_tokens([USER]), skip_special_tokens=False)
    assert prompt == "<|im_start|>user<|im_sep|>What is 2+2? ✨<|im_end|><|im_start|>assistant<|im_sep|>"
    assert tokenizer.stop_tokens == [end, tokenizer.engine.token_to_id("<|endoftext|>")]


def test_a_folder_without_config_json_is_told_by_its_im_sep_token(model_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    assert isinstance(from_pretrained(str(tmp_path)).chat_format, Phi4ChatFormat)


def test_masks_and_truncation(model_dir, conversations, check_masks):
    tokenizer = phi4_tokenizer(str(model_dir / "tokenizer.json"))
    for messages in conversations:
        check_masks(tokenizer, messages, [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"])


@pytest.fixture(scope="module")
def mini_dir(tmp_path_factory, corpus):
    return phi3_folder(tmp_path_factory, corpus, PHI4_MINI_SPECIALS)


def test_phi4_mini_chat_format_lays_out_the_published_turns(mini_dir):
    tokenizer = from_pretrained(str(mini_dir))
    assert isinstance(tokenizer.chat_format, Phi4MiniChatFormat)
    tokens, mask = tokenizer.tokenize_messages([SYSTEM, USER, ANSWER], add_eos=True, train_on="assistant")
    system, user, assistant, end, eos = (
        tokenizer.engine.token_to_id(t) for t in ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>")
    )
    text = tokenizer.engine.encode
    # Role tokens by id, contents as text, no newlines; the template's closing eos (no generation prompt) at the end.
    assert tokens == [
        system, *text("Be brief."), end, user, *text("What is 2+2? ✨"), end, assistant, *text("4"), end, eos,
    ]
    assert tokenizer.decode(tokens, skip_special_tokens=False) == (
        "<|system|>Be brief.<|end|><|user|>What is 2+2? ✨<|end|><|assistant|>4<|end|><|endoftext|>"
    )
    # Trained: the assistant's content, the <|end|> that closes it and the eos after it.
    assert mask == [False] * (len(tokens) - len(text("4")) - 2) + [True] * (len(text("4")) + 2)
    prompt = tokenizer.decode(tokenizer.prompt_tokens([SYSTEM, USER]), skip_special_tokens=False)
    assert prompt == "<|system|>Be brief.<|end|><|user|>What is 2+2? ✨<|end|><|assistant|>"
    assert tokenizer.stop_tokens == [end, eos]


def test_phi4_mini_masks_and_truncation(mini_dir, conversations, check_masks):
    tokenizer = phi4_mini_tokenizer(str(mini_dir / "tokenizer.json"))
    for messages in conversations:
        check_masks(tokenizer, messages, [m["content"] + "<|end|>" for m in messages if m["role"] == "assistant"])


def test_a_phi4_mini_folder_without_config_json_is_told_by_its_end_token(mini_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((mini_dir / "tokenizer.json").read_bytes())
    assert isinstance(from_pretrained(str(tmp_path)).chat_format, Phi4MiniChatFormat)


def test_a_phi3_folder_with_phi3s_sentencepiece_style_vocabulary_is_refused(tmp_path):
    # Phi-3 and Phi-3.5 have <|user|>...<|end|> too, as a vocabulary with byte fallback rather than byte level, and
    # another chat format (a newline after each role and each <|end|>).
    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.add_special_tokens(["<|endoftext|>", "<|user|>", "<|end|>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text('{"model_type": "phi3"}')
    with pytest.raises(UserError, match=r"tokenizer.json: neither Phi-4's <\|im_sep\|> token nor Phi-4-mini's "
                                        r"byte-level vocabulary with <\|end\|>") as e:
        from_pretrained(str(tmp_path))
    assert "\n" not in str(e.value)
