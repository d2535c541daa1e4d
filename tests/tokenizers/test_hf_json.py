"""Qwen's tokenizer.json tokenizer on a byte-level BPE the test trains, against the `tokenizers` library and
Qwen's published chat templates (through `transformers`' apply_chat_template)."""

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from toolkit.tokenizers import Qwen3ChatFormat, from_pretrained, qwen2_5_tokenizer, qwen3_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]  # added tokens that are not special in Qwen3's tokenizer.json
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
# The tool-free path of Qwen3's published chat template (the hybrid thinking models, e.g. Qwen3-8B): the
# `{%- if tools %}` branch and the tool_calls and tool-role branches are left out.
QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""  # noqa: E501

USER, ANSWER = {"role": "user", "content": "What is 2+2? ✨"}, {"role": "assistant", "content": "4"}
# Conversations covering each branch of Qwen3's template: reasoning given as reasoning_content or inline in
# content, kept only after the last user query, history stripped of it, newlines around it, a string
# reasoning_content that overrides inline tags, no user at all, a tool-response user turn, a late system turn.
QWEN3_CONVERSATIONS: list[list[dict]] = [
    [USER, ANSWER],
    [USER, {**ANSWER, "reasoning_content": "Two and two make four."}],
    [{"role": "system", "content": "Think first.\n"}, USER, {**ANSWER, "content": "<think>\nadd them\n</think>\n\n4"}],
    [
        {"role": "system", "content": "Réponds en français."},
        {"role": "user", "content": "Capitale du Japon ? 日本"},
        {"role": "assistant", "content": "<think>Japon → Tokyo</think>Tokyo 🗼", "reasoning_content": None},
        {"role": "user", "content": "Et de la Chine ?"},
        {"role": "assistant", "content": "\n\nPékin", "reasoning_content": "\n\nChine : 北京\n"},
    ],
    [USER, {"role": "assistant", "content": "Let me see.", "reasoning_content": "step one"},
     {"role": "assistant", "content": "It is 4.", "reasoning_content": ""}],
    [USER, {"role": "assistant", "content": "Hmm."}, {"role": "assistant", "content": "<think>sure</think> 4"}],
    [USER, {"role": "assistant", "content": "<think>kept as text</think>4", "reasoning_content": ""}],
    [{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "<think>x</think>Hello."}],
    [USER, ANSWER, {"role": "user", "content": "<tool_response>\n4\n</tool_response>"},
     {"role": "assistant", "content": "Confirmed.", "reasoning_content": "the tool agrees"}],
    [USER, {"role": "system", "content": "Answer in words."}, {**ANSWER, "content": "four"}],
    [USER, {**ANSWER, "reasoning_content": "easy"}, {"role": "user", "content": "<tool_response> is a tag?"},
     {"role": "assistant", "content": "Yes.", "reasoning_content": "it is"}],
    [USER, {**ANSWER, "reasoning_content": "easy"}, {"role": "user", "content": "And 3+3?"}],
]


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
    tokenizer.add_tokens(THINK_TOKENS)
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


@pytest.fixture(scope="module")
def reference(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))


@pytest.mark.interop
def test_qwen2_5_matches_the_published_template(model_dir, reference, conversations):
    tokenizer = qwen2_5_tokenizer(str(model_dir / "tokenizer.json"))
    for messages in conversations:
        expected = reference.apply_chat_template(messages, chat_template=QWEN2_5_TEMPLATE, tokenize=True)
        assert tokenizer.tokenize_messages(messages, add_eos=False)[0] == _ids(expected)
        expected = reference.apply_chat_template(
            messages[:-1], chat_template=QWEN2_5_TEMPLATE, tokenize=True, add_generation_prompt=True
        )
        assert tokenizer.prompt_tokens(messages[:-1]) == _ids(expected)


@pytest.mark.interop
def test_qwen3_matches_the_published_template(model_dir, reference, conversations):
    for messages in conversations + QWEN3_CONVERSATIONS:
        _check_qwen3(str(model_dir / "tokenizer.json"), reference, messages)


def _check_qwen3(path: str, reference, messages: list[dict]) -> None:
    for enable_thinking in (True, False):
        tokenizer = qwen3_tokenizer(path, enable_thinking=enable_thinking)
        expected = reference.apply_chat_template(
            messages, chat_template=QWEN3_TEMPLATE, tokenize=True, enable_thinking=enable_thinking
        )
        assert tokenizer.tokenize_messages(messages, add_eos=False)[0] == _ids(expected)
        # Prompts after the whole conversation and, when it ends with an answer, before that answer.
        for context in {len(messages), max(i for i, m in enumerate(messages) if m["role"] != "assistant") + 1}:
            expected = reference.apply_chat_template(
                messages[:context], chat_template=QWEN3_TEMPLATE, tokenize=True, add_generation_prompt=True,
                enable_thinking=enable_thinking,
            )
            assert tokenizer.prompt_tokens(messages[:context]) == _ids(expected)
    # The default is the template's when the caller says nothing: thinking enabled.
    expected = reference.apply_chat_template(
        messages, chat_template=QWEN3_TEMPLATE, tokenize=True, add_generation_prompt=True
    )
    assert qwen3_tokenizer(path).prompt_tokens(messages) == _ids(expected)


def _ids(encoded) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list.
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _trained(tokenizer, messages: list[dict], train_on: str = "assistant") -> str:
    tokens, mask = tokenizer.tokenize_messages(messages, add_eos=False, train_on=train_on)
    return tokenizer.decode([t for t, m in zip(tokens, mask) if m], skip_special_tokens=False)


def test_masks_and_truncation(model_dir, conversations, check_masks):
    tokenizer = qwen2_5_tokenizer(str(model_dir / "tokenizer.json"))
    for messages in conversations:
        bodies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        check_masks(tokenizer, messages, bodies)


def test_qwen3_trains_what_the_model_writes_after_the_last_query(model_dir, check_masks):
    path = str(model_dir / "tokenizer.json")
    thinking, answering = qwen3_tokenizer(path), qwen3_tokenizer(path, enable_thinking=False)
    # One exchange: the (empty) think block is written by the model when thinking is on, part of the
    # prompt when it is off.
    check_masks(thinking, [USER, ANSWER], ["<think>\n\n</think>\n\n4<|im_end|>"])
    assert _trained(answering, [USER, ANSWER]) == "4<|im_end|>"
    # History turns are context (shown stripped of reasoning); reasoning after the last query is trained
    # whatever enable_thinking says.
    messages = QWEN3_CONVERSATIONS[3]
    expected = "<think>\nChine : 北京\n</think>\n\nPékin<|im_end|>"
    for tokenizer in (thinking, answering):
        assert _trained(tokenizer, messages) == _trained(tokenizer, messages, "last_turn") == expected
    tokens, mask = thinking.tokenize_messages(messages, add_eos=False, train_on="all")
    assert mask == [False] + [True] * (len(tokens) - 1)
    # Every assistant turn after the last query is trained: here two, the first with its reasoning.
    assert _trained(thinking, QWEN3_CONVERSATIONS[4]) == (
        "<think>\nstep one\n</think>\n\nLet me see.<|im_end|><think>\n\n</think>\n\nIt is 4.<|im_end|>"
    )
    # A conversation ending with a user message has nothing the model wrote in reply to it.
    assert _trained(thinking, QWEN3_CONVERSATIONS[-1]) == ""


def test_qwen3_generation_prompt(model_dir):
    head = "<|im_start|>user\nWhat is 2+2? ✨<|im_end|>\n<|im_start|>assistant\n"
    for enable_thinking, tail in ((True, ""), (False, "<think>\n\n</think>\n\n")):
        tokenizer = qwen3_tokenizer(str(model_dir / "tokenizer.json"), enable_thinking=enable_thinking)
        assert tokenizer.decode(tokenizer.prompt_tokens([USER]), skip_special_tokens=False) == head + tail


def test_from_pretrained_reads_model_type(model_dir):
    (model_dir / "config.json").write_text('{"model_type": "qwen2"}')
    tokenizer = from_pretrained(str(model_dir))
    # Qwen2.5's template adds its default system prompt.
    prompt = tokenizer.decode(tokenizer.prompt_tokens([{"role": "user", "content": "hi"}]), skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\nYou are Qwen")


def test_from_pretrained_picks_qwen3_and_takes_a_chat_format(model_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    assert isinstance(from_pretrained(str(tmp_path)).chat_format, Qwen3ChatFormat)
    assert from_pretrained(str(tmp_path)).chat_format.enable_thinking
    tokenizer = from_pretrained(str(tmp_path), chat_format=Qwen3ChatFormat(enable_thinking=False))
    assert tokenizer.decode(tokenizer.prompt_tokens([USER]), skip_special_tokens=False).endswith("</think>\n\n")


def test_a_qwen3_moe_folder_gets_the_qwen3_tokenizer(model_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe"}')
    assert isinstance(from_pretrained(str(tmp_path)).chat_format, Qwen3ChatFormat)


def test_qwen3_configs_get_the_thinking_format(model_dir, tmp_path, config_chat_formats):
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    for path, chat_format in config_chat_formats("*/qwen3_*.yaml", tmp_path):
        assert isinstance(chat_format, Qwen3ChatFormat) and chat_format.enable_thinking, path
