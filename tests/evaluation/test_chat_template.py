"""Chat templates for lm-evaluation-harness: prompts rendered as text encode back to the tokens the tokenizer's own
chat layout gives (Llama 3's tiktoken tokenizer, Qwen's tokenizer.json ones, the byte tokenizer), answers are scored
on the tokens training lays out for them, and the settings that cannot work are refused with one line."""

import base64

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.tokenizers.test_sentencepiece import train as train_sentencepiece
from toolkit.errors import UserError
from toolkit.evaluation import ChatTemplate, check_chat_settings
from toolkit.tokenizers import (
    byte_tokenizer,
    gemma_tokenizer,
    llama2_tokenizer,
    llama3_tokenizer,
    mistral_tokenizer,
    qwen2_5_tokenizer,
    qwen3_tokenizer,
)

# What lm-eval builds: a question alone, after a system instruction, and after few-shot examples as earlier turns
# (fewshot_as_multiturn) or folded into one user message; whitespace the formats trim, and non-ASCII text.
CONVERSATIONS: list[list[dict]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of Japan?"}],
    [
        {"role": "system", "content": "Be brief.\n"},
        {"role": "user", "content": "Question: 2+2?\nAnswer:"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  Question: naïve café, 日本?\nAnswer:  "},
    ],
    [{"role": "user", "content": "Question: 2+2?\nAnswer: 4\n\nQuestion: 3+3?\nAnswer:"}],
]
ANSWER = "Paris, then Tokyo"
# What ends an assistant message in each format: Llama 3, Qwen, the byte tokenizer, Llama 2 and Mistral, Gemma.
CLOSERS = {"<|eot_id|>", "<|im_end|>\n", "<|eot|>", "</s>", "<end_of_turn>\n"}
# Words whose byte prefixes make a Llama 3 rank file: every prefix is a merge of the one before and a byte, as BPE
# training produces, so words of the prompts and answers become multi-byte tokens.
WORDS = ["\n\n", "user", "assistant", "system", " Paris", "Paris", " Tokyo", "Question", "Answer", " capital", "ing"]
# The special tokens of Qwen's tokenizer.json, and its think tags (added, but not special).
QWEN_SPECIALS, THINK_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<think>", "</think>"]


@pytest.fixture(scope="module")
def llama3_file(tmp_path_factory) -> str:
    ranks = {bytes([b]): b for b in range(256)}
    for word in WORDS:
        for end in range(2, len(word.encode()) + 1):
            ranks.setdefault(word.encode()[:end], len(ranks))
    path = tmp_path_factory.mktemp("llama3") / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()))
    return str(path)


@pytest.fixture(scope="module")
def qwen_file(tmp_path_factory) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=QWEN_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([str(m) for c in CONVERSATIONS for m in c] + [ANSWER] * 4, trainer)
    tokenizer.add_tokens(THINK_TOKENS)
    path = tmp_path_factory.mktemp("qwen") / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def sentencepiece_files(tmp_path_factory) -> dict[str, str]:
    """sentencepiece models trained on the conversations, laid out as Llama 2's, Mistral's and Gemma's (their
    control tokens as those families declare them; see tests/tokenizers/test_sentencepiece.py)."""
    corpus = [m["content"] for c in CONVERSATIONS for m in c] + [ANSWER] * 4 + ["Answer: Paris"] * 4
    options = {
        "llama2": {},
        "mistral": {"control_symbols": ["[INST]", "[/INST]"]},
        "gemma": dict(add_dummy_prefix=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
                      eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
                      user_defined_symbols=["<start_of_turn>", "<end_of_turn>"]),
    }
    paths = {}
    for family, extra in options.items():
        path = paths[family] = tmp_path_factory.mktemp(family) / "tokenizer.model"
        train_sentencepiece(corpus, path, **extra)
    return {family: str(path) for family, path in paths.items()}


TOKENIZERS = {
    "llama3": lambda files: llama3_tokenizer(files["llama3"]),
    "llama3.1": lambda files: llama3_tokenizer(files["llama3"], dated=True),
    "qwen2.5": lambda files: qwen2_5_tokenizer(files["qwen"]),
    "qwen3": lambda files: qwen3_tokenizer(files["qwen"]),
    "qwen3-no-thinking": lambda files: qwen3_tokenizer(files["qwen"], enable_thinking=False),
    "llama2": lambda files: llama2_tokenizer(files["llama2"]),
    "mistral": lambda files: mistral_tokenizer(files["mistral"]),
    "gemma": lambda files: gemma_tokenizer(files["gemma"]),
    "byte": lambda files: byte_tokenizer(),
}


@pytest.fixture(params=list(TOKENIZERS))
def tokenizer(request, llama3_file, qwen_file, sentencepiece_files):
    return TOKENIZERS[request.param]({"llama3": llama3_file, "qwen": qwen_file, **sentencepiece_files})


def closing(tokenizer, tokens: list[int], prefix: list[int]) -> str:
    """What ``tokens`` hold after ``prefix``, which must start them, as text with special tokens written out."""
    assert tokens[: len(prefix)] == prefix
    return tokenizer.decode(tokens[len(prefix):], skip_special_tokens=False)


def test_rendered_prompts_encode_to_the_tokenizers_chat_tokens(tokenizer):
    chat = ChatTemplate(tokenizer)
    for messages in CONVERSATIONS:
        text = chat.render(messages)
        assert chat.encode(text) == tokenizer.prompt_tokens(messages)


def test_a_continued_final_message_ends_where_its_content_does(tokenizer):
    # lm-eval's gen_prefix: the answer is prefilled and left open (add_generation_prompt=False).
    chat = ChatTemplate(tokenizer)
    for messages in CONVERSATIONS:
        prefilled = [*messages, {"role": "assistant", "content": "Answer:"}]
        text = chat.render(prefilled, add_generation_prompt=False)
        assert text.endswith("Answer:")
        trained, _ = tokenizer.tokenize_messages(prefilled, add_eos=False)
        # The tokens training lays out for that message, up to the token that closes it.
        assert closing(tokenizer, trained, chat.encode(text)) in CLOSERS


def test_llama3_prompts_are_the_published_template_with_one_bos(llama3_file):
    tokenizer = llama3_tokenizer(llama3_file)
    chat = ChatTemplate(tokenizer)
    text = chat.render(CONVERSATIONS[1])
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nAnswer in one word.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nCapital of Japan?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert chat.encode(text).count(tokenizer.bos_id) == 1 and chat.encode(text)[0] == tokenizer.bos_id
    assert chat.name == ChatTemplate(llama3_tokenizer(llama3_file)).name != ChatTemplate(
        llama3_tokenizer(llama3_file, dated=True)
    ).name


def test_an_answer_is_scored_on_the_tokens_training_lays_out_for_it(tokenizer, demo_model):
    pytest.importorskip("lm_eval")
    from toolkit.evaluation.lm_eval_model import ToolkitLM

    lm = ToolkitLM(demo_model, tokenizer, apply_chat_template=True)
    for messages in CONVERSATIONS:
        context = lm.apply_chat_template(messages)
        assert lm.encode_context(context) == tokenizer.prompt_tokens(messages)  # no second bos
        context_ids, answer_ids = lm.encode_pair(context, ANSWER)
        answered = [*messages, {"role": "assistant", "content": ANSWER}]
        trained, mask = tokenizer.tokenize_messages(answered, add_eos=False)
        if "<think>" in tokenizer.decode(trained[len(context_ids):]):
            # Qwen3 thinking: training puts the reasoning before the answer, which the model writes itself; lm-eval
            # scores the answer right after the prompt (as with its Hugging Face backend).
            continue
        if type(getattr(tokenizer, "chat_format", None)).__name__ == "Llama2ChatFormat":
            # Llama 2's "[INST]" and "[/INST]" are text, not special tokens, and training encodes the answer after
            # "[/INST]" as a message of its own (with sentencepiece's leading space); lm-eval, which under chat
            # templates puts no delimiter before a continuation, has it scored as text straight after "[/INST]", as
            # its Hugging Face backend scores Llama 2's published template: the answer's first token may differ
            # from training's (here "Paris" splits where training has one token). The prompt is exact (above).
            assert answer_ids == lm.encode_context(context + ANSWER)[len(context_ids):]
            continue
        assert closing(tokenizer, trained, context_ids + answer_ids) in CLOSERS
        # The scored tokens are the answer's, which training learns, after the whitespace that ends the generation
        # prompt (Llama 3's "\n\n" after the assistant header), which whitespace ending a context moves into the
        # continuation (lm-eval's convention, as its Hugging Face backend scores it).
        scored = mask[len(context_ids) : len(context_ids) + len(answer_ids)]
        first = scored.index(True)
        assert tokenizer.decode(answer_ids[:first]).strip() == "" and all(scored[first:])


def test_a_tokenizer_without_a_chat_template_is_named():
    class PlainTokenizer:
        max_seq_len = None

        def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = True) -> list[int]:
            return list(text.encode())

        def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
            return bytes(ids).decode()

    with pytest.raises(UserError, match=r"needs a tokenizer with a chat template; .*\.PlainTokenizer has none"):
        check_chat_settings(PlainTokenizer(), apply_chat_template=True, fewshot_as_multiturn=False)
    check_chat_settings(PlainTokenizer(), apply_chat_template=False, fewshot_as_multiturn=False)


def test_a_model_tokenizer_without_a_chat_format_is_named(llama3_file):
    tokenizer = llama3_tokenizer(llama3_file)
    tokenizer.chat_format = None
    with pytest.raises(UserError, match=r"toolkit.tokenizers.model_tokenizer.ModelTokenizer has none"):
        ChatTemplate(tokenizer)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"apply_chat_template": False, "fewshot_as_multiturn": True},
         r"^lm_eval.fewshot_as_multiturn: true needs lm_eval.apply_chat_template: true"),
        ({"apply_chat_template": "chatml", "fewshot_as_multiturn": False},
         r"^lm_eval.apply_chat_template must be true or false, got 'chatml'$"),
    ],
)
def test_settings_that_cannot_work_are_refused(settings, message):
    with pytest.raises(UserError, match=message):
        check_chat_settings(byte_tokenizer(), **settings)


def test_without_apply_chat_template_the_adapter_renders_nothing(demo_model):
    pytest.importorskip("lm_eval")
    from toolkit.evaluation.lm_eval_model import ToolkitLM

    with pytest.raises(RuntimeError, match="built with apply_chat_template=False"):
        ToolkitLM(demo_model, byte_tokenizer()).apply_chat_template(CONVERSATIONS[0])
