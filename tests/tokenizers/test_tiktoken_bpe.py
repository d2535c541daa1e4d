"""Llama 3's tiktoken tokenizer on a BPE rank file the test trains, against tiktoken and Llama 3's template."""

import base64
import collections

import jinja2
import pytest
import regex
import tiktoken

from toolkit.errors import UserError
from toolkit.tokenizers import from_pretrained, llama3_tokenizer
from toolkit.tokenizers.tiktoken_bpe import LLAMA3_PATTERN, llama3_special_tokens

# Llama 3's published chat template (Meta-Llama-3-8B-Instruct's tokenizer_config.json).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def train_byte_bpe(corpus: list[str], num_merges: int) -> dict[bytes, int]:
    """Byte-level BPE: start from the 256 bytes, repeatedly merge the most frequent adjacent pair."""
    words = collections.Counter(
        tuple(bytes([b]) for b in piece.encode()) for text in corpus for piece in regex.findall(LLAMA3_PATTERN, text)
    )
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(num_merges):
        pairs = collections.Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda item: (item[1], item[0]))
        ranks[a + b] = len(ranks)
        merged = collections.Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return ranks


@pytest.fixture(scope="module")
def rank_file(tmp_path_factory, corpus):
    ranks = train_byte_bpe(corpus, num_merges=300)
    path = tmp_path_factory.mktemp("llama3") / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return path, ranks


@pytest.fixture
def reference(rank_file):
    path, ranks = rank_file
    specials = {t: len(ranks) + i for i, t in enumerate(llama3_special_tokens())}
    return tiktoken.Encoding("reference", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def test_ids_match_tiktoken(rank_file, reference, samples):
    tokenizer = llama3_tokenizer(str(rank_file[0]))
    assert tokenizer.vocab_size == len(rank_file[1]) + 256
    for text in samples:
        # Special-token strings inside text are text: tiktoken with no special tokens allowed agrees.
        expected = reference.encode(text, disallowed_special=())
        assert tokenizer.encode(text, add_bos=False, add_eos=False) == expected
        assert tokenizer.decode(expected) == text
    ids = tokenizer.encode("hi", add_bos=True, add_eos=True)
    assert ids[0] == reference.encode("<|begin_of_text|>", allowed_special="all")[0]
    assert ids[-1] == tokenizer.eos_id == reference.encode("<|end_of_text|>", allowed_special="all")[0]


def test_chat_format_matches_the_published_template(rank_file, reference, conversations):
    tokenizer = llama3_tokenizer(str(rank_file[0]))
    template = jinja2.Environment().from_string(LLAMA3_TEMPLATE)
    for messages in conversations:
        for prompt in (False, True):
            rendered = template.render(messages=messages, bos_token="<|begin_of_text|>", add_generation_prompt=prompt)
            expected = reference.encode(rendered, allowed_special="all")
            if prompt:
                assert tokenizer.prompt_tokens(messages) == expected
            else:
                assert tokenizer.tokenize_messages(messages, add_eos=False)[0] == expected


def test_masks_and_truncation(rank_file, conversations, check_masks):
    tokenizer = llama3_tokenizer(str(rank_file[0]))
    for messages in conversations:
        bodies = [m["content"].strip() + "<|eot_id|>" for m in messages if m["role"] == "assistant"]
        check_masks(tokenizer, messages, bodies)


def test_from_pretrained_finds_the_original_file(rank_file, tmp_path):
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "tokenizer.model").write_bytes(rank_file[0].read_bytes())
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    tokenizer = from_pretrained(str(tmp_path), max_seq_len=7)
    assert tokenizer.max_seq_len == 7 and tokenizer.stop_tokens[0] == tokenizer.special_id("<|eot_id|>")


def test_bad_rank_file_names_file_and_line(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_text("aGk= 0\nnot a line\n")
    with pytest.raises(UserError, match=r"tokenizer.model:2: not a tiktoken BPE line"):
        llama3_tokenizer(str(path))
