"""lm-evaluation-harness's model interface (``lm_eval.api.model.LM``) over a toolkit decoder and tokenizer.

Importing this module imports ``lm_eval`` (the ``eval`` extra). Recipes go through
:func:`toolkit.evaluation.load_lm_eval_tasks`, which imports it only when tasks are asked for and says how to install
it when it is missing.
"""

import contextlib
import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from torch import nn
from torch.distributed.tensor import DTensor

from toolkit.errors import UserError
from toolkit.evaluation.chat_template import ChatTemplate
from toolkit.generation import generate

# The generation settings a generate_until request may carry. Any other (beam search, repetition penalty...) is an
# error rather than silently ignored, since it would change the numbers.
GENERATION_KWARGS: frozenset[str] = frozenset({"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"})
# lm-eval's budget when a task sets no max_gen_toks.
DEFAULT_MAX_GEN_TOKS = 256

# A context and a continuation to score after it, as token ids.
TokenPair = tuple[list[int], list[int]]


class ToolkitLM(LM):
    """Answers lm-eval's three kinds of request with a toolkit decoder.

    - ``loglikelihood``: the summed log-probability of each continuation's tokens after its context, and whether
      greedy decoding would produce exactly them. Context and continuation are encoded together and split where the
      context's own encoding ends, so the boundary tokenizes as in running text; whitespace that ends the context
      moves to the continuation (lm-eval's convention: ``" Paris"`` is scored, not ``"Paris"``). A sequence longer than
      the model's ``max_seq_len`` loses the start of its context. Requests run ``batch_size`` at a time, longest
      first, right-padded (causal attention: padding after a row changes nothing before it).
    - ``loglikelihood_rolling``: the log-probability of a whole text after the tokenizer's bos, in windows of
      ``max_seq_len`` tokens that predict every token exactly once; a window after the first starts with the token
      before the ones it predicts, and the last one takes the full window of context (lm-eval's definition).
    - ``generate_until``: :func:`toolkit.generation.generate` with the KV cache, greedy unless the request's
      ``gen_kwargs`` ask to sample (``do_sample``, or a positive ``temperature`` without ``do_sample``; ``top_k``,
      ``top_p``), until a stop string of ``until``, one of the tokenizer's stop tokens, ``max_gen_toks`` new tokens
      or the model's ``max_seq_len``. The text is cut before the first stop string. A context longer than
      ``max_seq_len - 1`` tokens keeps its end.

    Chat templates (``apply_chat_template=True``, for models fine-tuned on conversations): lm-eval renders each
    prompt as a conversation with :meth:`apply_chat_template`, the tokenizer's own chat format (see
    :class:`~toolkit.evaluation.chat_template.ChatTemplate`), and the contexts of ``loglikelihood`` and
    ``generate_until`` are such renderings: they are encoded with the format's special tokens read back as those
    tokens and without a bos of their own, so the model sees the tokens training laid out for the same messages.
    Whitespace ending a generation prompt (Llama 3's ``\\n\\n`` after the assistant header) is scored with each
    continuation, by the convention above, as lm-eval's Hugging Face backend scores it. An answer is encoded as text
    after the prompt's text: where a format's turn markers are text rather than special tokens (Llama 2's
    ``[/INST]``), its first token can differ from the one training gives the answer as a message of its own, as with
    that backend. ``loglikelihood_rolling`` texts are never rendered (lm-eval scores them as plain text).

    Several processes: lm-eval is told it runs on one process (its ``rank`` and ``world_size`` stay 0 and 1), so
    every process runs the whole harness on every document, and this adapter shares out the model's work itself:
    each process scores or generates its share of the requests and the answers are all-gathered, so every process
    returns every answer and the harness computes the same metrics on each. A model sharded by FSDP2 all-gathers
    each layer's weights in every forward, a collective, so there every process runs as many scoring batches as the
    busiest one (idle ones on a single token), and every process generates for every request (the same weights and
    prompts give the same tokens), rather than stopping after different numbers of tokens. A sampled generation draws
    from a generator of its own, seeded from ``seed`` and the request's index, so its text does not depend on which
    process generates it or on the requests before it, and copies of one request (lm-eval's ``repeats``) are
    different draws. lm-eval's own splitting needs an ``accelerate`` object before 0.4.11 and pads the
    requests of uneven ranks with duplicates; this way works the same on every 0.4 release.

    Args:
        model: a plain decoder (``toolkit.modules.TransformerDecoder``), or one sharded in place by FSDP2.
        tokenizer: a toolkit tokenizer whose ``encode`` keeps every token (``max_seq_len`` None): this adapter cuts
            sequences from the left itself, where a tokenizer would cut the continuation off their end.
        batch_size: sequences per forward pass when scoring.
        autocast: context for forward passes (mixed precision without FSDP2), e.g. the recipe's precision policy's.
        rank: this process's rank among ``world_size`` processes that share the work.
        world_size: processes that call every method together with the same requests.
        group: the process group of those processes (default: all); under tensor parallelism the data-parallel
            group, ``rank`` and ``world_size`` its rank and size (the ranks of a TP group run the same forwards).
        seed: with each request's index, seeds the generator of its sampled generation.
        apply_chat_template: contexts are conversations rendered by :meth:`apply_chat_template` (lm-eval's option of
            the same name).

    Raises:
        UserError: ``apply_chat_template`` with a tokenizer that has no chat template.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        batch_size: int = 16,
        autocast: contextlib.AbstractContextManager | None = None,
        rank: int = 0,
        world_size: int = 1,
        group: dist.ProcessGroup | None = None,
        seed: int = 0,
        apply_chat_template: bool = False,
    ) -> None:
        super().__init__()
        if tokenizer.max_seq_len is not None:
            raise ValueError(
                "ToolkitLM needs a tokenizer that keeps every token (max_seq_len=None); it truncates from the left itself"
            )
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise UserError(f"lm_eval batch_size must be a positive integer, got {batch_size!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.autocast = autocast or contextlib.nullcontext()
        self.process_rank = rank
        self.num_processes = world_size
        self.group = group
        self.max_seq_len: int = model.max_seq_len
        self._device = model.token_embedding().weight.device
        self.sharded = any(isinstance(p, DTensor) for p in model.parameters())
        self.seed = seed
        self._generate_calls = 0  # a later generate_until call gets other draws than an earlier one
        self.chat = ChatTemplate(tokenizer) if apply_chat_template else None

    # --- chat templates -------------------------------------------------------------------------------------------

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as the tokenizer's chat format renders it: ending with the prompt for an assistant answer,
        or (``add_generation_prompt=False``) with the final message left open, which lm-eval uses to prefill the
        answer with a task's ``gen_prefix``."""
        if self.chat is None:
            raise RuntimeError("lm-eval asked a ToolkitLM built with apply_chat_template=False for a chat template")
        return self.chat.render(chat_history, add_generation_prompt=add_generation_prompt)

    @property
    def tokenizer_name(self) -> str:
        """Names the tokenizer and its chat format in lm-eval's request cache keys."""
        if self.chat is None:
            raise RuntimeError("tokenizer_name names a chat template; this ToolkitLM has apply_chat_template=False")
        return self.chat.name

    def encode_context(self, context: str) -> list[int]:
        """A request's context as ids: after the tokenizer's bos (when the vocabulary has one), or, with chat
        templates, as the chat format laid it out (its own bos, if any, already first)."""
        if self.chat is not None:
            return self.chat.encode(context)
        return self.tokenizer.encode(context, add_bos=True, add_eos=False)

    # --- loglikelihood --------------------------------------------------------------------------------------------

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), greedy)`` for each request's ``(context, continuation)``."""
        pairs = []
        for request in requests:
            context, continuation = request.args[0], request.args[1]
            pair = self.encode_pair(context, continuation)
            if len(pair[1]) > self.max_seq_len:
                raise UserError(
                    f"lm_eval task {request.task_name}, document {request.doc_id}: a continuation of {len(pair[1])} "
                    f"tokens does not fit the model's max_seq_len ({self.max_seq_len})"
                )
            pairs.append(pair)
        return self.score(pairs)

    def loglikelihood_rolling(self, requests: list[Instance]) -> list[float]:
        """The log-probability of each request's whole text, window by window (see the class docstring)."""
        windows: list[TokenPair] = []
        owners: list[int] = []
        for i, request in enumerate(requests):
            tokens = self.tokenizer.encode(request.args[0], add_bos=False, add_eos=False)
            for window in self.rolling_windows(tokens):
                windows.append(window)
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self.score(windows)):
            totals[owner] += logprob
        return totals

    def encode_pair(self, context: str, continuation: str) -> TokenPair:
        """Token ids of ``context`` (as :meth:`encode_context` gives them) and of ``continuation`` after it.

        An empty context becomes the bos token (eos for vocabularies without one), so the first continuation token
        is still predicted from something.
        """
        stripped = context.rstrip()
        continuation = context[len(stripped):] + continuation
        context_ids = self.encode_context(stripped)
        whole = self.encode_context(stripped + continuation)
        return context_ids or [self.tokenizer.bos_id], whole[len(context_ids):]

    def rolling_windows(self, tokens: list[int]) -> list[TokenPair]:
        """``tokens`` after bos as ``(context, continuation)`` windows of at most ``max_seq_len`` inputs whose
        continuations cover every token once, in order."""
        seq = [self.tokenizer.bos_id, *tokens]
        windows = []
        for start in range(1, len(seq), self.max_seq_len):  # start: the first token the window predicts
            end = min(start + self.max_seq_len, len(seq))
            first_input = max(0, end - 1 - self.max_seq_len)
            windows.append((seq[first_input:start], seq[start:end]))
        return windows

    @torch.no_grad()
    def score(self, pairs: Sequence[TokenPair]) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation token), all tokens greedy)`` for each ``(context, continuation)``, the
        sequence cut from the left to ``max_seq_len + 1`` tokens. A collective when ``world_size > 1``: every
        process passes the same pairs and gets every result."""
        # Longest first: a batch holds similar lengths (little padding), and running out of memory happens at once.
        order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]), reverse=True)
        mine = order[self.process_rank :: self.num_processes]
        # Under FSDP2 every process runs as many batches as process 0, which holds the most requests.
        busiest = len(order[:: self.num_processes]) if self.sharded else len(mine)
        results: dict[int, tuple[float, bool]] = {}
        was_training = self.model.training
        self.model.eval()
        try:
            for first in range(0, busiest, self.batch_size):
                batch = mine[first : first + self.batch_size]
                results.update(zip(batch, self._score_batch([pairs[i] for i in batch])))
        finally:
            self.model.train(was_training)
        return self._all_gather(results, len(pairs))

    def _score_batch(self, pairs: list[TokenPair]) -> list[tuple[float, bool]]:
        """One forward pass over ``pairs`` (a single-token forward, scoring nothing, when there are none)."""
        sequences = [(context + continuation)[-(self.max_seq_len + 1) :] for context, continuation in pairs]
        inputs = [seq[:-1] for seq in sequences] or [[self.tokenizer.pad_id]]
        tokens = torch.full((len(inputs), max(1, *map(len, inputs))), self.tokenizer.pad_id, dtype=torch.long)
        for row, ids in enumerate(inputs):
            tokens[row, : len(ids)] = torch.tensor(ids)
        with self.autocast:
            logits = self.model(tokens.to(self._device))  # [b, s, vocab]
        scores = []
        for row, (_, continuation) in enumerate(pairs):
            end = len(inputs[row])
            # Positions end - c .. end - 1 predict the c continuation tokens; float32 before the softmax.
            logprobs = logits[row, end - len(continuation) : end].float().log_softmax(-1)  # [c, vocab]
            targets = torch.tensor(continuation, dtype=torch.long, device=logprobs.device)
            picked = logprobs.gather(-1, targets[:, None]).squeeze(-1)  # [c]
            scores.append((float(picked.double().sum()), bool((logprobs.argmax(-1) == targets).all())))
        return scores

    # --- generate_until -------------------------------------------------------------------------------------------

    def generate_until(self, requests: list[Instance]) -> list[str]:
        """Generated text for each request's ``(context, gen_kwargs)``, cut before the first stop string."""
        settings = [self._generation_settings(request) for request in requests]
        # Under FSDP2 every process generates for every request (see the class docstring); else each its share.
        mine = range(len(requests)) if self.sharded else range(self.process_rank, len(requests), self.num_processes)
        call, self._generate_calls = self._generate_calls, self._generate_calls + 1
        texts = {
            i: self._generate(requests[i].args[0], **settings[i], generator=self._generator(call, i)) for i in mine
        }
        return [texts[i] for i in range(len(requests))] if self.sharded else self._all_gather(texts, len(requests))

    def _generation_settings(self, request: Instance) -> dict:
        """The request's ``gen_kwargs`` as arguments of :meth:`_generate`."""
        kwargs = dict(request.args[1])
        unsupported = sorted(set(kwargs) - GENERATION_KWARGS)
        if unsupported:
            raise UserError(
                f"lm_eval task {request.task_name}: generation_kwargs {unsupported} are not supported "
                f"(supported: {sorted(GENERATION_KWARGS)})"
            )
        until = kwargs.get("until") or []
        temperature = float(kwargs.get("temperature", 0.0))
        sample = bool(kwargs.get("do_sample", temperature > 0))
        return {
            "until": [until] if isinstance(until, str) else [s for s in until if s],
            "max_new_tokens": int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)),
            # do_sample without a temperature samples from the model's distribution as it is (temperature 1).
            "temperature": (temperature or 1.0) if sample else 0.0,
            "top_k": kwargs.get("top_k"),
            "top_p": kwargs.get("top_p"),
        }

    def _generator(self, call: int, index: int) -> torch.Generator:
        """The random stream of request ``index`` of this adapter's ``call``-th ``generate_until``: the same on every
        process, and another for every request (a hash of the three numbers seeds it)."""
        digest = hashlib.sha256(f"{self.seed},{call},{index}".encode()).digest()
        return torch.Generator(device=self._device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)

    def _generate(
        self, context: str, *, until: list[str], max_new_tokens: int, temperature: float, top_k: int | None,
        top_p: float | None, generator: torch.Generator,
    ) -> str:
        prompt = self.encode_context(context) or [self.tokenizer.bos_id]

        def reached_stop_string(generated: list[int]) -> bool:
            text = self.tokenizer.decode(generated)
            return any(stop in text for stop in until)

        with self.autocast:
            generated = generate(
                self.model, prompt[-(self.max_seq_len - 1) :], max_new_tokens=max_new_tokens,
                stop_tokens=self.tokenizer.stop_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                generator=generator, stop_when=reached_stop_string if until else None,
            )
        text = self.tokenizer.decode(generated)
        for stop in until:
            text = text.split(stop, 1)[0]
        return text

    # --- several processes ------------------------------------------------------------------------------------------

    def _all_gather(self, mine: dict, count: int) -> list:
        """Every process's ``{request index: answer}`` merged, as a list over ``range(count)``."""
        if self.num_processes > 1:
            parts: list[dict | None] = [None] * self.num_processes
            dist.all_gather_object(parts, mine, group=self.group)
            mine = {i: answer for part in parts for i, answer in part.items()}
        return [mine[i] for i in range(count)]
