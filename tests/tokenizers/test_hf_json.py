"""Qwen's tokenizer.json tokenizer on a byte-level BPE the test trains, against the `tokenizers` library and
Qwen's published ChatML templates (through `transformers`' apply_chat_template)."""

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from toolkit.tokenizers import from_pretrained, qwen2_5_tokenizer, qwen3_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenization split (digits one at a time), then byte-level mapping as in its tokenizer.json.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The tool-free path of Qwen2.5-Instruct's published chat template.
QWEN2_5_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if (message.role == \"user\") or "
    "(message.role == \"system\" and not loop.first) or (message.role == \"assistant\") %}{{- '<|im_start|>' + "
    "message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Plain ChatML, as Qwen3's template renders conversations without reasoning content.
CHATML_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, corpus):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    folder = tmp_path_factory.mktemp("qwen")
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_ids_match_the_tokenizers_library(model_dir, samples):
    reference = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    reference.encode_special_tokens = True  # special-token strings in text stay text
    tokenizer = qwen2_5_tokenizer(str(model_dir / "tokenizer.json"))
    for text in samples:
        expected = reference.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text, add_bos=True, add_eos=False) == expected  # Qwen has no bos
        assert tokenizer.decode(expected) == text
    assert tokenizer.encode("x")[-1] == tokenizer.eos_id == reference.token_to_id("<|endoftext|>")


@pytest.mark.interop
@pytest.mark.parametrize("build,template", [(qwen2_5_tokenizer, QWEN2_5_TEMPLATE), (qwen3_tokenizer, CHATML_TEMPLATE)])
def test_chat_format_matches_the_published_template(model_dir, conversations, build, template):
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    tokenizer = build(str(model_dir / "tokenizer.json"))
    for messages in conversations:
        expected = reference.apply_chat_template(messages, chat_template=template, tokenize=True)
        assert tokenizer.tokenize_messages(messages, add_eos=False)[0] == list(_ids(expected))
        expected = reference.apply_chat_template(
            messages[:-1], chat_template=template, tokenize=True, add_generation_prompt=True
        )
        assert tokenizer.prompt_tokens(messages[:-1]) == list(_ids(expected))


def _ids(encoded) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list.
    return encoded["input_ids"] if hasattr(encoded, "keys") else encoded


def test_masks_and_truncation(model_dir, conversations, check_masks):
    tokenizer = qwen3_tokenizer(str(model_dir / "tokenizer.json"))
    for messages in conversations:
        bodies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        check_masks(tokenizer, messages, bodies)


def test_from_pretrained_reads_model_type(model_dir):
    (model_dir / "config.json").write_text('{"model_type": "qwen2"}')
    tokenizer = from_pretrained(str(model_dir))
    # Qwen2.5's template adds its default system prompt.
    prompt = tokenizer.decode(tokenizer.prompt_tokens([{"role": "user", "content": "hi"}]), skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\nYou are Qwen")
