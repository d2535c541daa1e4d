"""Bytes a forward and backward pass hold for their tokens: the tensors autograd saves for backward
(:func:`activation_bytes`, and :func:`offloaded_activation_bytes` for those activation offloading moves to host
memory), the buffers of the logits and the loss (:func:`logits_bytes`) and those of the experts' token exchange
under expert parallelism (:func:`all_to_all_bytes`).

Everything here grows with the tokens of a micro batch and depends on how the step computes (precision, activation
checkpointing and offloading, the attention and loss kernels, the experts' exchange), never on how the parameters
are sharded:
:mod:`toolkit.planning.memory` adds it to each data-parallel strategy's parameters, gradients and optimizer state.
The counts are analytic, from the shapes of a :class:`~toolkit.modules.TransformerDecoder` (on the meta device a
70B model costs nothing), and checked against the tensors PyTorch saves and allocates in
``tests/planning/test_memory.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from toolkit.errors import UserError
from toolkit.modules.attention import GroupedQueryAttention
from toolkit.modules.gemma2 import GemmaRMSNorm
from toolkit.modules.moe import MoEFeedForward
from toolkit.training.activations import checkpoint_interval, checkpointed_layers


@dataclass(frozen=True)
class _Precision:
    stored: int  # bytes per stored (master) parameter, gradient and optimizer-state element
    compute: int  # bytes per element of activations and of gathered compute weights
    autocast_when_replicated: bool  # mixed modes run under torch.autocast with DDP/ZeRO-1 (precision.py)


# The table in toolkit/training/precision.py, in bytes. Here because the formulas need the compute dtype;
# toolkit.planning.memory reads the stored dtype and autocast from it too.
_PRECISIONS = {
    "fp32": _Precision(stored=4, compute=4, autocast_when_replicated=False),
    "bf16": _Precision(stored=2, compute=2, autocast_when_replicated=False),
    "bf16-mixed": _Precision(stored=4, compute=2, autocast_when_replicated=True),
    "fp16-mixed": _Precision(stored=4, compute=2, autocast_when_replicated=True),
}


def _precision(dtype: str) -> _Precision:
    if dtype not in _PRECISIONS:
        raise UserError(f"dtype: unknown value {dtype!r}; choose one of {', '.join(_PRECISIONS)}")
    return _PRECISIONS[dtype]


# --- The model's shape ---------------------------------------------------------------------------------------------


def _out_features(module: nn.Module) -> int:
    # nn.Linear says out_features; adapters and quantized projections at least carry a [out, in] weight.
    out = getattr(module, "out_features", None)
    return int(out) if out is not None else int(module.weight.shape[0])


def _norm_bytes_per_token(norm: nn.Module, *, embed_dim: int, compute: int, autocast: bool) -> int:
    """What a norm saves per token: its input as fp32 (a copy unless fp32), 1/rms, and the normalized value the
    weight's gradient needs, in the compute dtype (fp32 under autocast, where mul is not autocast, and in
    Gemma's norm, which scales before casting back)."""
    normed = 4 if autocast or isinstance(norm, GemmaRMSNorm) else compute
    return (4 + normed) * embed_dim + 4


def _head_normed_bytes(norm: nn.Module, compute: int) -> int:
    return 4 if isinstance(norm, GemmaRMSNorm) else compute


def _layer_activation_bytes_per_token(
    layer: nn.Module, *, embed_dim: int, seq_len: int, compute: int, autocast: bool, flex_attention: bool = False,
    tensor_parallel: int = 1, expert_parallel: int = 1,
) -> int:
    """Bytes one decoder layer saves for backward per token on one rank (the formula of :func:`activation_bytes`).

    Under tensor parallelism each rank computes its ``1/tensor_parallel`` of the heads and of the MLP width
    (``apply_tp``'s column-wise q/k/v and gate/up), so every term of those shrinks; the norms, their inputs and the
    projections' inputs are whole on every rank (the residual stream is replicated), so those terms do not."""
    attn, mlp, d, c, t = layer.self_attn, layer.mlp, embed_dim, compute, tensor_parallel
    if not isinstance(attn, GroupedQueryAttention):
        raise UserError(
            "micro_batch_size, data_parallel and tensor_parallel: auto sizes activations by the toolkit's own layers, "
            "and this model's are transformers' (the transformers backend); give them numbers"
        )
    n_h, n_kv, h_d = attn.num_heads // t, attn.num_kv_heads // t, attn.head_dim
    q_dim, kv_dim = n_h * h_d, n_kv * h_d
    norms = [m for name, m in layer.named_children() if name not in ("self_attn", "mlp")]
    # Under autocast every projection casts its input to bf16 separately (autocast caches casts of weights
    # only), so q, k, v, gate and up each save their own copy instead of sharing one per block.
    projection_inputs = 5 if autocast else 2
    total = sum(_norm_bytes_per_token(norm, embed_dim=d, compute=c, autocast=autocast) for norm in norms)
    total += projection_inputs * c * d
    # Rotary embeddings save only cos/sin (buffers). SDPA saves rotated q and k, v, its output and the fp32
    # logsumexp [b, n_h, s]; o_proj's input is a view of that output (flash kernels lay it out as [b, s, n_h, h_d]).
    total += c * (2 * q_dim + 2 * kv_dim) + 4 * n_h
    if attn.q_norm is not None:
        # Per-head norms save their fp32 input copy, rsqrt and normalized value (Qwen3; in fp32 for Gemma 3's,
        # which scale before casting back).
        total += (4 + _head_normed_bytes(attn.q_norm, c)) * q_dim + 4 * n_h
    if attn.k_norm is not None:
        total += (4 + _head_normed_bytes(attn.k_norm, c)) * kv_dim + 4 * n_kv
    if attn.logit_softcap is not None and not flex_attention:
        # Explicit attention (Gemma 2) instead of SDPA's logsumexp: repeated k and v, then per query and head
        # the scores' tanh, the fp32 softmax and its cast (masks of size s x s per layer are not counted).
        cast = c if c != 4 else 0  # the softmax's cast back to the compute dtype, a no-op in fp32
        total += 2 * c * q_dim + n_h * seq_len * (c + 4 + cast) - 4 * n_h
    return total + _mlp_bytes_per_token(
        mlp, embed_dim=d, compute=c, tensor_parallel=t, expert_parallel=expert_parallel
    )


def _mlp_bytes_per_token(
    mlp: nn.Module, *, embed_dim: int, compute: int, tensor_parallel: int, expert_parallel: int = 1
) -> int:
    """What a layer's feed-forward saves per token: SwiGLU's gate and up outputs, the activation's output and the
    product (down_proj's input). A mixture-of-experts block (never split by tensor parallelism) saves per token
    (:func:`_moe_bytes_per_token`) that for each of its ``top_k`` expert assignments, and the routing's tensors."""
    if isinstance(mlp, MoEFeedForward):
        return _moe_bytes_per_token(mlp, embed_dim=embed_dim, compute=compute, expert_parallel=expert_parallel)
    return 4 * compute * (_out_features(mlp.gate_proj) // tensor_parallel)


def _moe_bytes_per_token(mlp: MoEFeedForward, *, embed_dim: int, compute: int, expert_parallel: int) -> int:
    """What :class:`~toolkit.modules.moe.MoEFeedForward` saves per token, with ``k`` assignments (``top_k``) of
    width ``d`` and experts of hidden width ``h`` (the block's input is counted with the projections' inputs)::

        k * c * (3d + 4h)   per assignment: the experts' input rows (their first matmuls'), the experts' output rows
                            (kept by the unsort back to token order: index_copy's backward keeps its source), the
                            unsorted output (kept by the mix with the routing weights); SwiGLU's four h-wide tensors
        + k * (16 + c)      the chosen experts (topk's int64 indices), the sort order (int64), the routing weights
                            in the compute dtype (the mix's other factor)
        + 4 * E             the router's float32 scores over the ``E`` experts (the softmax's output, which the
                            load-balancing loss also keeps)
        + 4 * k + 4         with ``norm_topk_prob``: the top-k scores and their sum (the renormalization's division)

    Under expert parallelism (``expert_parallel`` > 1) the exchange (:mod:`toolkit.parallel.expert_parallel`) keeps
    per assignment ``c * d + 8`` more: the experts' output rows again (the received rows' own unsort back to source
    order, before they are sent back) and that sort order. The rows a rank's experts compute are those routed to
    them from every rank of its group: at balanced routing as many as its own tokens' assignments, which is what
    is counted; an unbalanced router gives the busiest rank more (``expert_load_busiest_share`` in the metrics).
    The grouped matmuls' int32 offsets (3 per layer, one per local expert) are not counted. Under autocast (DDP and
    ZeRO-1 in the mixed modes; never with expert parallelism) the experts run in whatever precision the device's
    kernels give them (CPU's grouped matmul is not autocast and runs them in float32): not modeled, they are counted
    in the compute dtype."""
    k, d, c = mlp.top_k, embed_dim, compute
    hidden = mlp.experts.gate_proj.shape[1]
    total = k * c * (3 * d + 4 * hidden) + k * (16 + c) + 4 * mlp.num_experts
    if mlp.gate.norm_topk_prob:
        total += 4 * k + 4
    if expert_parallel > 1:
        total += k * (c * d + 8)
    return total


def _activations_per_token(
    model: nn.Module, *, seq_len: int, dtype: str = "bf16-mixed", activation_checkpointing: bool | int = False,
    autocast: bool = False, flex_attention: bool = False, tensor_parallel: int = 1, expert_parallel: int = 1,
) -> tuple[list[int], int, int]:
    """Bytes per token that :func:`activation_bytes` and :func:`offloaded_activation_bytes` add up: what each layer
    keeps from its forward to its backward, what a checkpointed layer holds again while it is recomputed (the
    largest), and what the model keeps outside its layers. The keyword arguments are those of
    :func:`activation_bytes`, with its defaults."""
    compute = _precision(dtype).compute
    autocast = autocast and _precision(dtype).stored != compute
    d = model.token_embedding().embedding_dim
    full = [
        _layer_activation_bytes_per_token(
            layer, embed_dim=d, seq_len=seq_len, compute=compute, autocast=autocast, flex_attention=flex_attention,
            tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
        )
        for layer in model.decoder_layers().values()
    ]
    checkpointed = set(checkpointed_layers(len(full), checkpoint_interval(activation_checkpointing)))
    residual = (4 if autocast else compute) * d  # a checkpointed layer's input: the residual stream (fp32 in autocast)
    kept = [residual if i in checkpointed else b for i, b in enumerate(full)]
    recomputed = max((full[i] for i in checkpointed), default=0)
    head = 8 + _norm_bytes_per_token(model.final_norm(), embed_dim=d, compute=compute, autocast=autocast) + compute * d
    return kept, recomputed, head


def activation_bytes(
    model: nn.Module,
    *,
    micro_batch_size: int,
    seq_len: int,
    dtype: str = "bf16-mixed",
    activation_checkpointing: bool | int = False,
    activation_offloading: bool = False,
    autocast: bool = False,
    flex_attention: bool = False,
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
) -> int:
    """Bytes autograd keeps for backward on the device after one forward pass, without the logits (see
    :func:`logits_bytes`).

    With ``t = micro_batch_size * seq_len`` tokens, ``d`` the model width, ``c`` the compute dtype's bytes,
    ``n_h``/``n_kv`` query/key-value heads of ``h_d`` features, ``f`` the MLP width and ``k`` norms per layer, a
    Llama-style layer (RMSNorm, rotary SDPA attention, SwiGLU) saves per token::

        k * (4d + c*d + 4)      each norm: its input in fp32 (a copy unless fp32), normalized value, 1/rms
        + 2 * c*d               the attention and MLP inputs, each saved once for its projections
        + c * (2*n_h*h_d + 2*n_kv*h_d) + 4*n_h   rotated q and k, v, attention output, fp32 logsumexp
        + 4 * c*f               gate and up outputs, SiLU output, their product

    Under autocast (mixed precision with DDP or ZeRO-1) the residual stream and norms stay fp32 (``c*d`` becomes
    ``4d`` in the norm term) and each of the five projections q, k, v, gate, up saves its own bf16 copy of its
    input (``2*c*d`` becomes ``5*c*d``). Per-head q/k norms and soft-capped attention add their own terms, and a
    mixture-of-experts feed-forward has its own in place of SwiGLU's (:func:`_moe_bytes_per_token`). The model
    adds ``8`` bytes of token ids and the final norm, ``4d + 2*c*d + 4``, per token.

    A checkpointed layer keeps only its input, ``c*d`` per token (``4d`` under autocast), and the largest
    checkpointed layer's full activations exist again while it is recomputed in backward. With every k-th layer
    checkpointed, the other layers keep everything.

    With activation offloading the layers' tensors wait in host memory; the device holds at most two layers'
    worth at a time (the layer running and the one whose copy is in flight, in forward and in backward), plus a
    checkpointed layer being recomputed. Tensors below the offloader's size threshold stay on the device and are
    not counted there: a fraction of a percent.

    The formula is exact for the tensors PyTorch's CPU and flash/memory-efficient SDPA kernels save (checked
    against ``saved_tensors_hooks`` in the tests); attention masks (per-document ones of packed batches, the
    sliding-window band of Gemma's local layers under SDPA, ``s x s`` per layer) are not counted.
    With a frozen base (LoRA) a norm with a frozen weight saves no normalized value and LoRA adds rank-sized
    tensors: there the estimate is a few percent high.

    Args:
        model: a :class:`~toolkit.modules.TransformerDecoder`, on any device (meta is fine).
        micro_batch_size: sequences per forward pass.
        seq_len: tokens per sequence.
        dtype: the precision mode.
        activation_checkpointing: false, true (every layer) or k (every k-th layer: 0, k, 2k, ...).
        activation_offloading: the layers' saved tensors are kept in host memory (see
            :func:`offloaded_activation_bytes` for how much).
        autocast: mixed precision through ``torch.autocast`` rather than low-precision parameters.
        flex_attention: attention runs on FlexAttention, which soft-caps scores inside its kernel: soft-capped
            layers save what SDPA layers do, not their scores.
        tensor_parallel: ranks each layer is split over; the result is one rank's. What is split by heads (q, k,
            v, the attention output, its logsumexp or scores, per-head norms) or by the MLP width (gate, up, their
            product) is divided by it; the norms and the projections' inputs (the replicated residual stream) and
            the model's own head terms are not.
        expert_parallel: ranks the experts of each mixture-of-experts layer are shared out over; the exchange of
            tokens keeps a copy of the experts' output rows more (see :func:`_moe_bytes_per_token`).
    """
    kept, recomputed, head = _activations_per_token(
        model, seq_len=seq_len, dtype=dtype, activation_checkpointing=activation_checkpointing, autocast=autocast,
        flex_attention=flex_attention, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
    )
    layers = sum(sorted(kept)[-2:]) if activation_offloading else sum(kept)
    return micro_batch_size * seq_len * (layers + recomputed + head)


def offloaded_activation_bytes(model: nn.Module, *, micro_batch_size: int, seq_len: int, **kwargs: Any) -> int:
    """Host memory that activation offloading fills: every layer's saved tensors (with checkpointing, only the
    checkpointed layers' inputs and the other layers' tensors).

    Args:
        model, micro_batch_size, seq_len, **kwargs: as in :func:`activation_bytes` (``dtype``,
            ``activation_checkpointing``, ``autocast``, ``flex_attention``, ``tensor_parallel``, ``expert_parallel``;
            ``activation_offloading`` aside, which this implies).
    """
    kept, _, _ = _activations_per_token(model, seq_len=seq_len, **kwargs)
    return micro_batch_size * seq_len * sum(kept)


def all_to_all_bytes(
    model: nn.Module, *, micro_batch_size: int, seq_len: int, dtype: str = "bf16-mixed", expert_parallel: int = 1
) -> int:
    """Bytes the experts' token exchange (:mod:`toolkit.parallel.expert_parallel`) holds beyond the saved
    activations, on one rank, while one mixture-of-experts layer's experts run: 0 without expert parallelism.

    With ``t`` tokens, ``k`` experts per token, width ``d`` and ``c`` bytes per element: ``3 * t * k * d * c``.
    When the outputs come back (the second all-to-all), three buffers of assignment rows are alive besides the
    saved tensors: the rows this rank sent (held by the experts' forward until the exchange returns), the rows it
    received (held by the exchange until it returns) and the outputs it sends back; the outputs it receives are
    kept for backward and counted with the activations (:func:`activation_bytes`). Backward's two exchanges hold
    two such buffers each, sent and received, while the layer's saved tensors are being freed; a checkpointed layer
    runs its forward's exchange again when it is recomputed. One layer exchanges at a time. As for the
    activations, a rank is counted as receiving as many rows as it sends (balanced routing).
    """
    blocks = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    if expert_parallel == 1 or not blocks:
        return 0
    rows = micro_batch_size * seq_len * max(block.top_k for block in blocks)
    return 3 * rows * model.token_embedding().embedding_dim * _precision(dtype).compute


def logits_bytes(
    model: nn.Module,
    *,
    micro_batch_size: int,
    seq_len: int,
    dtype: str = "bf16-mixed",
    loss_chunks: int | None = None,
    fused: bool = False,
    tensor_parallel: int = 1,
) -> int:
    """Peak bytes of the logits and the loss, on one rank.

    Whole logits: ``t * vocab * (12 + c)``. The caller holds the logits (``c`` bytes each) through backward; the
    loss upcasts them and log-softmax saves its fp32 output (4); at the start of backward the fp32 gradients of the
    log-probabilities and of the logits (4 + 4) exist together with both.

    In ``loss_chunks`` chunks (:func:`~toolkit.modules.loss.chunked_cross_entropy_sum`): ``t * vocab * (c + f /
    n)``. Every chunk's logits are kept for backward in the compute dtype, and only one chunk at a time has its
    float32 log-softmax (forward) or softmax (backward): ``f = 4``, or ``8`` when the chunk is upcast to it first
    (``c`` of 2). A trainable output weight also has a transient copy of its gradient per chunk, which is not
    counted.

    Fused (``fused``, the decoder's ``labels=`` path, :func:`~toolkit.modules.loss.linear_cross_entropy_sum`, when
    the model's output layer allows it, LoRA included): ``ceil(t / n) * vocab * (c + f) + t * d * c``. Only one
    chunk's logits exist at any time, with their float32 log-softmax; what outlives the forward is the hidden
    states' gradient (``t * d``), and the output weight's, which is counted with the gradients (a tied weight's is
    a transient copy until it is added to the embedding's). A LoRA output with dropout adds ``3 * t * d * c``: the
    dropped-out adapter input (through the forward), its gradient (until backward) and dropout's mask (kept in
    ``c`` bytes on CPU, 1 on CUDA: there this is slightly high).

    Under tensor parallelism (``tensor_parallel`` ranks; the fused loss only, which the schema requires with it)
    each rank computes its vocabulary shard of each chunk, ``vocab / tensor_parallel`` columns, while the hidden
    states and their gradient are whole on every rank.

    Soft-capped logits (Gemma 2) save their tanh as well (``c``), in every case. Each form is measured with an
    allocation tracker to within 1% (``tests/planning/test_memory.py``).
    """
    compute = _precision(dtype).compute
    embedding = model.token_embedding()
    vocab = embedding.num_embeddings
    softcap = compute if getattr(model, "final_logit_softcap", None) else 0
    tokens = micro_batch_size * seq_len
    one_chunk = 4 if compute == 4 else 8
    if fused and model.fused_loss_weight() is not None:
        rows = math.ceil(tokens / (loss_chunks or 1))
        output = model.output_projection()
        hidden = 4 if getattr(output, "dropout_p", 0.0) > 0 else 1  # a LoRA output's dropped-out input
        width = embedding.embedding_dim
        vocab = math.ceil(vocab / tensor_parallel)  # the vocabulary-parallel loss: this rank's columns only
        return rows * vocab * (compute + one_chunk + softcap) + hidden * tokens * width * compute
    tokens_x_vocab = tokens * vocab
    if not loss_chunks:
        return tokens_x_vocab * (12 + compute + softcap)
    return tokens_x_vocab * (compute + softcap) + math.ceil(tokens_x_vocab * one_chunk / loss_chunks)
