"""Llama 2, Mistral and Gemma tokenizers on sentencepiece models the test trains, against sentencepiece itself
and each family's published chat format."""

import io
import json

import jinja2
import pytest
import sentencepiece as spm

from toolkit.errors import UserError
from toolkit.tokenizers import from_pretrained, gemma_tokenizer, llama2_tokenizer, mistral_tokenizer
from toolkit.tokenizers.chat_templates import MistralChatFormat

# Gemma's published chat template (gemma-2-*-it tokenizer_config.json).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

# Gemma 3's published chat template (gemma-3-*-it tokenizer_config.json): a system message is folded, untrimmed,
# into the first user turn; content may also be a list of parts (text, or an image placeholder).
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n"
)


def train(corpus: list[str], path, **options) -> spm.SentencePieceProcessor:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=400, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, minloglevel=2, **options,
    )
    path.write_bytes(model.getvalue())
    return spm.SentencePieceProcessor(model_file=str(path))


@pytest.fixture(scope="module")
def llama2_model(tmp_path_factory, corpus):
    path = tmp_path_factory.mktemp("llama2") / "tokenizer.model"
    return path, train(corpus, path)


@pytest.fixture(scope="module")
def mistral_model(tmp_path_factory, corpus):
    path = tmp_path_factory.mktemp("mistral") / "tokenizer.model"
    return path, train(corpus, path, control_symbols=["[INST]", "[/INST]"])


@pytest.fixture(scope="module")
def gemma_model(tmp_path_factory, corpus):
    path = tmp_path_factory.mktemp("gemma") / "tokenizer.model"
    sp = train(
        corpus, path, add_dummy_prefix=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
        eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
    )
    return path, sp


@pytest.mark.parametrize("family", ["llama2", "mistral", "gemma"])
def test_ids_match_sentencepiece(request, samples, family):
    path, sp = request.getfixturevalue(f"{family}_model")
    build = {"llama2": llama2_tokenizer, "mistral": mistral_tokenizer, "gemma": gemma_tokenizer}[family]
    tokenizer = build(str(path))
    for text in samples:
        if family == "gemma" and "<start_of_turn>" in text:
            continue  # sentencepiece itself matches Gemma's user-defined turn markers inside text
        expected = sp.encode(text)
        assert tokenizer.encode(text, add_bos=False, add_eos=False) == expected
        assert tokenizer.decode(expected) == sp.decode(expected)
    ids = tokenizer.encode("hi")
    assert (ids[0], ids[-1]) == (sp.bos_id(), sp.eos_id()) == (tokenizer.bos_id, tokenizer.eos_id)


def test_llama2_matches_meta_reference_encoding(llama2_model, conversations):
    # Meta's chat_completion: each exchange encoded on its own as bos + "[INST] {user} [/INST] {answer} " + eos,
    # the system prompt in <<SYS>> tags inside the first user turn, the open user turn without eos.
    path, sp = llama2_model
    tokenizer = llama2_tokenizer(str(path))
    messages = conversations[1]
    first_user = f"<<SYS>>\n{messages[0]['content']}\n<</SYS>>\n\n{messages[1]['content'].strip()}"
    expected = (
        [sp.bos_id()] + sp.encode(f"[INST] {first_user} [/INST] {messages[2]['content'].strip()} ") + [sp.eos_id()]
        + [sp.bos_id()] + sp.encode(f"[INST] {messages[3]['content'].strip()} [/INST] {messages[4]['content']} ")
        + [sp.eos_id()]
    )
    assert tokenizer.tokenize_messages(messages)[0] == expected
    prompt = [sp.bos_id()] + sp.encode(f"[INST] {messages[3]['content'].strip()} [/INST]")
    assert tokenizer.prompt_tokens(messages[:4])[-len(prompt):] == prompt


def test_mistral_matches_its_instruct_encoding(mistral_model, conversations):
    # Mistral's v3 tokenizer: bos, then [INST] user [/INST] as control tokens around the encoded text, the
    # answer encoded and closed by eos; the system prompt joins the last user message.
    path, sp = mistral_model
    tokenizer = mistral_tokenizer(str(path))
    inst, end_inst = sp.piece_to_id("[INST]"), sp.piece_to_id("[/INST]")
    messages = conversations[1]
    last_user = f"{messages[0]['content']}\n\n{messages[3]['content'].strip()}"
    expected = (
        [sp.bos_id(), inst] + sp.encode(messages[1]["content"]) + [end_inst] + sp.encode("Blue.") + [sp.eos_id()]
        + [inst] + sp.encode(last_user) + [end_inst] + sp.encode("Red") + [sp.eos_id()]
    )
    assert tokenizer.tokenize_messages(messages)[0] == expected


def test_mistral_v1_writes_inst_as_text_as_its_template_does(llama2_model, conversations):
    # Mistral's first vocabulary (Mixtral 8x7B Instruct v0.1) has no [INST] piece: its template renders
    # bos + "[INST] {user} [/INST]" + "{answer}" + eos per exchange, unstripped, and the reference tokenizer encodes
    # each text run between special tokens as sentencepiece does. (This vocabulary is llama2_model's: <s>, </s> and
    # no [INST].)
    path, sp = llama2_model
    tokenizer = mistral_tokenizer(str(path))
    assert tokenizer.chat_format.control_tokens is False
    messages = conversations[1]
    system, first, answer, second, last = (m["content"] for m in messages[:5])
    expected = (
        [sp.bos_id()] + sp.encode(f"[INST] {first} [/INST]{answer}") + [sp.eos_id()]
        + sp.encode(f"[INST] {system.strip()}\n\n{second} [/INST]{last}") + [sp.eos_id()]
    )
    assert tokenizer.tokenize_messages(messages)[0] == expected
    # The prompt to generate from: the open user turn, nothing after it.
    assert tokenizer.prompt_tokens(messages[:4]) == (
        [sp.bos_id()] + sp.encode(f"[INST] {first} [/INST]{answer}") + [sp.eos_id()]
        + sp.encode(f"[INST] {system.strip()}\n\n{second} [/INST]"))
    # The answers alone are trained, each with its eos.
    tokens, mask = tokenizer.tokenize_messages(messages, train_on="assistant")
    trained = tokenizer.decode([t for t, m in zip(tokens, mask) if m], skip_special_tokens=False)
    assert trained.replace(" ", "") == f"{answer}</s>{last}</s>".replace(" ", "")


def test_gemma_matches_the_published_template(gemma_model, conversations):
    path, sp = gemma_model
    tokenizer = gemma_tokenizer(str(path))
    template = jinja2.Environment().from_string(GEMMA_TEMPLATE)
    messages = conversations[1][1:]  # Gemma's template refuses system messages
    for prompt in (False, True):
        rendered = template.render(messages=messages, bos_token="<bos>", add_generation_prompt=prompt)
        # The turn markers are user-defined pieces: sentencepiece encodes the rendered text exactly.
        expected = [sp.bos_id()] + sp.encode(rendered.removeprefix("<bos>"))
        if prompt:
            assert tokenizer.prompt_tokens(messages) == expected
        else:
            assert tokenizer.tokenize_messages(messages, add_eos=False)[0] == expected


@pytest.mark.parametrize("model_type", ["gemma3", "gemma3_text"])
def test_gemma3_folders_match_gemma3s_template(gemma_model, conversations, tmp_path, model_type):
    # Gemma 3 (the multimodal 4B-27B and the text-only 1B) ships Gemma's sentencepiece format with the same turn
    # markers; its template, in the folder's tokenizer_config.json, takes a system message.
    path, sp = gemma_model
    (tmp_path / "tokenizer.model").write_bytes(path.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": GEMMA3_TEMPLATE}))
    tokenizer = from_pretrained(str(tmp_path))
    template = jinja2.Environment().from_string(json.loads((tmp_path / "tokenizer_config.json").read_text())[
        "chat_template"])
    spaced = [{"role": "system", "content": "  Be brief. \n"}, *conversations[0]]  # kept untrimmed
    for messages in (*conversations, spaced):
        for prompt in (False, True):
            shown = messages[:-1] if prompt else messages
            rendered = template.render(messages=shown, bos_token="<bos>", add_generation_prompt=prompt)
            expected = [sp.bos_id()] + sp.encode(rendered.removeprefix("<bos>"))
            if prompt:
                assert tokenizer.prompt_tokens(shown) == expected
            else:
                assert tokenizer.tokenize_messages(shown, add_eos=False)[0] == expected


@pytest.mark.parametrize("family", ["llama2", "mistral", "gemma"])
def test_masks_and_truncation(request, conversations, check_masks, family):
    path, _ = request.getfixturevalue(f"{family}_model")
    build = {"llama2": llama2_tokenizer, "mistral": mistral_tokenizer, "gemma": gemma_tokenizer}[family]
    end = {"llama2": "</s>", "mistral": "</s>", "gemma": "<end_of_turn>"}[family]
    tokenizer = build(str(path))
    for messages in conversations:
        bodies = [m["content"].strip() + end for m in messages if m["role"] == "assistant"]
        check_masks(tokenizer, messages, bodies)


def test_from_pretrained_tells_families_apart(llama2_model, mistral_model, gemma_model, tmp_path):
    for (path, _), name in [(llama2_model, "<s>"), (mistral_model, "[INST]"), (gemma_model, "<start_of_turn>")]:
        folder = tmp_path / name.strip("<>[]/")
        folder.mkdir()
        (folder / "tokenizer.model").write_bytes(path.read_bytes())
        tokenizer = from_pretrained(str(folder))
        assert tokenizer.special_id(name) is not None


@pytest.mark.parametrize(("vocabulary", "control_tokens"), [("mistral_model", True), ("llama2_model", False)])
def test_a_mixtral_folder_gets_the_mistral_tokenizer(request, vocabulary, control_tokens, tmp_path):
    # Mixtral ships Mistral's sentencepiece vocabulary (8x22B the v3 one with [INST] control tokens, 8x7B the first,
    # without); its config.json says model_type mixtral.
    (tmp_path / "tokenizer.model").write_bytes(request.getfixturevalue(vocabulary)[0].read_bytes())
    (tmp_path / "config.json").write_text('{"model_type": "mixtral"}')
    chat_format = from_pretrained(str(tmp_path)).chat_format
    assert isinstance(chat_format, MistralChatFormat) and chat_format.control_tokens is control_tokens


def test_llama2_rejects_turns_out_of_order(llama2_model):
    tokenizer = llama2_tokenizer(str(llama2_model[0]))
    with pytest.raises(UserError, match="message 1 is 'assistant', not 'user'"):
        tokenizer.tokenize_messages([{"role": "assistant", "content": "hi"}])
    # Counted from 1 with the system message, as the row shows them: the third is the second user turn.
    with pytest.raises(UserError, match="message 3 is 'user', not 'assistant'"):
        tokenizer.tokenize_messages([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                     {"role": "user", "content": "again"}])
