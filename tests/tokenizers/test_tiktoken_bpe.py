"""Llama 3's tiktoken tokenizer on a BPE rank file the test trains, against tiktoken and Llama 3.x's templates."""

import base64
import collections
import json

import jinja2
import pytest
import regex
import tiktoken

from toolkit.errors import UserError
from toolkit.tokenizers import Llama3ChatFormat, from_pretrained, llama3_tokenizer
from toolkit.tokenizers.tiktoken_bpe import LLAMA3_PATTERN, llama3_special_tokens

# Llama 3's published chat template (Meta-Llama-3-8B-Instruct's tokenizer_config.json).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# The tool-free path of Llama 3.1's and 3.3's published template (Llama-3.1-8B-Instruct's tokenizer_config.json):
# the custom_tools, tools_in_user_message, builtin_tools and tools branches and the tool-message branches are
# left out.
LLAMA3_1_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""  # noqa: E501
# Llama 3.2's differs in where the date comes from: the clock, through transformers' strftime_now, unless the
# caller gives date_string.
LLAMA3_2_TEMPLATE = LLAMA3_1_TEMPLATE.replace(
    """    {%- set date_string = "26 Jul 2024" %}\n""",
    """    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}\n""",
)
# Beyond the shared conversations: whitespace to trim, an empty system message, a system message alone, Unicode.
DATED_CONVERSATIONS: list[list[dict]] = [
    [{"role": "system", "content": "\n  Be kind.  \n"}, {"role": "user", "content": "  hi  "},
     {"role": "assistant", "content": "\tHello!\n"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "日本語で答えて 🎌"},
     {"role": "assistant", "content": "はい、わかりました。", "reasoning_content": "ignored by Llama"}],
    [{"role": "system", "content": "Only a system prompt."}],
    [{"role": "user", "content": "naïve café?"}],
]


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


def _render(template: str, messages: list[dict], **kwargs) -> str:
    # transformers' own Jinja environment (trim_blocks, lstrip_blocks, strftime_now), as apply_chat_template uses.
    render_jinja_template = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    rendered, _ = render_jinja_template([messages], chat_template=template, bos_token="<|begin_of_text|>", **kwargs)
    return rendered[0]


@pytest.mark.interop
def test_dated_chat_format_matches_the_published_templates(rank_file, reference, conversations):
    default = llama3_tokenizer(str(rank_file[0]), dated=True)
    other_day = llama3_tokenizer(str(rank_file[0]), dated=True, date_string="05 Mar 2025")
    for messages in conversations + DATED_CONVERSATIONS:
        for prompt in (False, True):
            cases = [
                (default, LLAMA3_1_TEMPLATE, {}),
                (other_day, LLAMA3_1_TEMPLATE, {"date_string": "05 Mar 2025"}),
                (other_day, LLAMA3_2_TEMPLATE, {"date_string": "05 Mar 2025"}),
            ]
            for tokenizer, template, date in cases:
                rendered = _render(template, messages, add_generation_prompt=prompt, **date)
                expected = reference.encode(rendered, allowed_special="all")
                if prompt:
                    assert tokenizer.prompt_tokens(messages) == expected
                else:
                    assert tokenizer.tokenize_messages(messages, add_eos=False)[0] == expected
    text = default.decode(default.prompt_tokens([{"role": "user", "content": "hi"}]), skip_special_tokens=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


@pytest.mark.parametrize("dated", [False, True])
def test_masks_and_truncation(rank_file, conversations, check_masks, dated):
    tokenizer = llama3_tokenizer(str(rank_file[0]), dated=dated)
    for messages in conversations + DATED_CONVERSATIONS[:2]:
        bodies = [m["content"].strip() + "<|eot_id|>" for m in messages if m["role"] == "assistant"]
        check_masks(tokenizer, messages, bodies)


def test_from_pretrained_finds_the_original_file(rank_file, tmp_path):
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "tokenizer.model").write_bytes(rank_file[0].read_bytes())
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    tokenizer = from_pretrained(str(tmp_path), max_seq_len=7)
    assert tokenizer.max_seq_len == 7 and tokenizer.stop_tokens[0] == tokenizer.special_id("<|eot_id|>")


LLAMA3_1_CONFIG = {"model_type": "llama", "rope_scaling": {"factor": 8.0, "rope_type": "llama3"}}


@pytest.mark.parametrize(
    "files,dated",
    [
        # The chat template decides when it is a Llama 3 one, wherever transformers saved it...
        ({"tokenizer_config.json": {"chat_template": LLAMA3_1_TEMPLATE}}, True),
        ({"tokenizer_config.json": {"chat_template": [{"name": "default", "template": LLAMA3_2_TEMPLATE}]}}, True),
        ({"chat_template.jinja": LLAMA3_1_TEMPLATE, "tokenizer_config.json": {}}, True),
        ({"tokenizer_config.json": {"chat_template": LLAMA3_TEMPLATE}, "config.json": LLAMA3_1_CONFIG}, False),
        # ... else Llama 3.1's RoPE scaling, in config.json or Meta's params.json.
        ({"tokenizer_config.json": {"chat_template": "{{ messages }}"}, "config.json": LLAMA3_1_CONFIG}, True),
        ({"config.json": LLAMA3_1_CONFIG}, True),
        ({"config.json": {"model_type": "llama", "rope_scaling": None}}, False),
        ({"original/params.json": {"dim": 2048, "use_scaled_rope": True}}, True),
        ({"original/params.json": {"dim": 4096}}, False),
        ({}, False),
    ],
)
def test_from_pretrained_tells_llama3_1_from_3_0(rank_file, tmp_path, files, dated):
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "tokenizer.model").write_bytes(rank_file[0].read_bytes())
    for name, content in files.items():
        (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    assert from_pretrained(str(tmp_path)).chat_format.dated is dated


def test_from_pretrained_llama3_1_folder_matches_its_template(rank_file, reference, tmp_path, conversations):
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "tokenizer.model").write_bytes(rank_file[0].read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_1_CONFIG))
    tokenizer = from_pretrained(str(tmp_path))
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(LLAMA3_1_TEMPLATE)
    for messages in conversations:
        rendered = template.render(messages=messages, bos_token="<|begin_of_text|>", add_generation_prompt=False)
        expected = reference.encode(rendered, allowed_special="all")
        assert tokenizer.tokenize_messages(messages, add_eos=False)[0] == expected
    # A config may name the format itself, e.g. another date.
    tokenizer = from_pretrained(str(tmp_path), chat_format=Llama3ChatFormat(dated=True, date_string="1 Jan 2025"))
    assert "Today Date: 1 Jan 2025\n\n" in tokenizer.decode(tokenizer.prompt_tokens([]), skip_special_tokens=False)


def test_broken_tokenizer_config_is_named(rank_file, tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(rank_file[0].read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(UserError, match=r"tokenizer_config.json: not valid JSON"):
        from_pretrained(str(tmp_path))


def test_bad_rank_file_names_file_and_line(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_text("aGk= 0\nnot a line\n")
    with pytest.raises(UserError, match=r"tokenizer.model:2: not a tiktoken BPE line"):
        llama3_tokenizer(str(path))


def test_llama3_configs_use_the_dated_format(rank_file, tmp_path, config_chat_formats):
    # Even for a folder that says nothing of its version, the named Llama 3.1+ configs ask for the dated format;
    # configs for any checkpoint get it from a 3.1 folder's files.
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "tokenizer.model").write_bytes(rank_file[0].read_bytes())
    for path, chat_format in config_chat_formats("*/llama3_*.yaml", tmp_path):
        assert chat_format.dated and chat_format.date_string == "26 Jul 2024", path
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_1_CONFIG))
    for path, chat_format in config_chat_formats("*/any_model*.yaml", tmp_path):
        assert chat_format.dated, path
