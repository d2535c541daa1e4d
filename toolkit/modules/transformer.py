"""A decoder-only transformer assembled from the blocks passed to it."""

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from toolkit.modules.attention import DocumentMasks, GroupedQueryAttention
from toolkit.modules.contract import DecoderLayers
from toolkit.modules.masks import CROSS_ENTROPY_IGNORE_INDEX
from toolkit.modules.distillation import DistillTargets, linear_distillation_sum
from toolkit.modules.kv_cache import KVCache
from toolkit.modules.loss import (
    LoRAAdapter,
    chunked_cross_entropy_sum,
    chunked_sequence_logprobs,
    linear_cross_entropy_sum,
    linear_sequence_logprobs,
    logit_loss_and_grad,
)
from toolkit.modules.moe import MoEFeedForward, routing_statistics
from toolkit.modules.peft.lora import LoRALinear


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class TransformerDecoderLayer(nn.Module):
    """Pre-norm residual block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""

    def __init__(
        self,
        *,
        self_attn: GroupedQueryAttention,
        mlp: nn.Module,
        input_layernorm: nn.Module,
        post_attention_layernorm: nn.Module,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), mask=mask, input_pos=input_pos)
        return h + self.mlp(self.post_attention_layernorm(h))


class TransformerDecoder(nn.Module):
    """Token embedding, a stack of layers, a final norm and the output projection.

    The model knows nothing of parallelism: data-parallel wrappers, tensor parallelism, activation checkpointing
    and compilation are applied from outside (``toolkit.parallel``, ``toolkit.training``), layer by layer, through
    the model contract (:class:`~toolkit.modules.contract.DecoderModel`: :meth:`decoder_layers`,
    :meth:`token_embedding`, :meth:`final_norm`, :meth:`output_projection`). The losses, logits and KV caches below
    reach the embedding, output projection and layers through the same methods, so a subclass whose parts are held
    elsewhere (the ``transformers`` backend) implements those and keeps the rest.

    Args:
        embed_tokens: the token embedding.
        layers: the decoder layers, in order (numbered from 0); or, for a model holding only some of a larger
            model's layers, a mapping from each one's index in that model (as a string, ascending) to the layer
            (:class:`~toolkit.modules.contract.DecoderLayers`: the names, and so the state-dict keys, stay the
            larger model's).
        norm: the final norm.
        output: the output projection; ``None`` ties it to ``embed_tokens.weight`` (Llama 3.2 1B/3B).
        max_seq_len: longest sequence the position embeddings support.
        router_aux_loss_coef: weight of the load-balancing loss of the mixture-of-experts layers
            (:class:`~toolkit.modules.moe.MoEFeedForward`) in the training loss; ignored without them.
    """

    def __init__(
        self,
        *,
        embed_tokens: nn.Embedding,
        layers: Sequence[nn.Module] | Mapping[str, nn.Module],
        norm: nn.Module,
        output: nn.Linear | None,
        max_seq_len: int,
        router_aux_loss_coef: float = 0.0,
    ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = DecoderLayers(layers)
        self.norm = norm
        self.output = output
        self.max_seq_len = max_seq_len
        self.router_aux_loss_coef = router_aux_loss_coef
        # The mixture-of-experts blocks, in order (a plain list: they are registered through self.layers), and what
        # their routers did in training forwards since the trainer last took it (take_routing_totals).
        self._moe_blocks = [m for m in self.layers.modules() if isinstance(m, MoEFeedForward)]
        self._routing_totals: dict[str, torch.Tensor] | None = None
        self._router_loss: torch.Tensor | None = None  # a per-sequence forward's, for its caller (take_router_loss)
        # The fused loss's work between its matmuls; toolkit.training.compile_model replaces it with a compiled one.
        self.output_loss_kernel = logit_loss_and_grad

    final_logit_softcap: float | None = None  # soft-capped logits (SoftcappedTransformerDecoder)

    @property
    def tie_word_embeddings(self) -> bool:
        return self.output_projection() is None

    def decoder_layers(self) -> dict[str, nn.Module]:
        """The decoder layers, in order, by module path (``layers.<index in the whole model>``)."""
        return {f"layers.{name}": layer for name, layer in self.layers.named_children()}

    def token_embedding(self) -> nn.Embedding:
        """The token embedding."""
        return self.embed_tokens

    def final_norm(self) -> nn.Module:
        """The norm after the last layer."""
        return self.norm

    def output_projection(self) -> nn.Module | None:
        """The output projection; None when tied to the token embedding."""
        return self.output

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
        num_output_chunks: int | None = None,
        labels: torch.Tensor | None = None,
        fused_loss: bool = True,
        lengths: torch.Tensor | None = None,
        per_sequence: bool = False,
        distill: DistillTargets | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[b, s, vocab]`` for ``tokens`` ``[b, s]`` (mask and input_pos as in the attention layer), or,
        given ``labels``, the summed float32 cross-entropy against them.

        Args:
            tokens: token ids ``[b, s]``.
            mask: attention mask, as in the attention layer, or :class:`~toolkit.modules.attention.DocumentMasks`,
                which gives each layer its FlexAttention block mask.
            input_pos: positions, as in the attention layer.
            num_output_chunks: return a list of this many logit tensors ``[b, s_i, vocab]`` that split the sequence
                in order (``torch.tensor_split`` sizes, so any count works; chunks past the sequence's end are
                empty). Each is projected from its own slice of the hidden states, so no ``[b, s, vocab]`` tensor is
                made and a chunked loss (``toolkit.modules.loss.chunked_cross_entropy_sum``) can upcast one chunk
                at a time. It is an argument rather than a model attribute so that other callers of the same model
                (validation, generation) keep getting one tensor. With ``labels``: the chunks the loss is computed
                in (None: 1).
            labels: ``[b, s]``, already shifted (ignored positions at ``CROSS_ENTROPY_IGNORE_INDEX``): return the
                sum of the token losses instead of the logits. The loss is computed inside the forward so that
                data-parallel wrappers (FSDP2's gathered output weight) see it as part of the model.
            fused_loss: with ``labels``, project and take the loss together
                (:func:`~toolkit.modules.loss.linear_cross_entropy_sum`: no logits outlive their chunk) when the
                output projection allows it (:meth:`fused_loss_weight`: a plain weight, or LoRA on one); otherwise,
                or when False, through chunked logits.
            lengths: ``[b]``, each row's length before its padding (``toolkit.data.padded_collate`` gives it). The
                routers' load statistics of a mixture-of-experts model count only those positions (all without it).
            per_sequence: with ``labels``, return each row's summed float32 log-probability of its labels, ``[b]``,
                instead of the loss sum (preference losses compare them): fused as the loss is
                (:func:`~toolkit.modules.loss.linear_sequence_logprobs`), or from the chunked logits; a
                mixture-of-experts model's load-balancing loss (its rows' summed, in a training forward with grad)
                is kept for the caller to add (:meth:`take_router_loss`).
            distill: with ``labels``, a teacher's final hidden states and output weight
                (:class:`DistillTargets`): return ``(cross-entropy sum, distillation sum)``, the second the summed
                divergence between this model's and the teacher's distributions at the same target positions
                (:func:`~toolkit.modules.distillation.linear_distillation_sum`: chunked, no logits kept).
            return_hidden: return the final hidden states ``[b, s, d]`` (after the final norm) instead of logits:
                what a teacher gives its student's ``distill``. Called as the forward, so that data-parallel
                wrappers gather the weights as for any forward.

        With ``labels``, in training mode, a mixture-of-experts model adds its load-balancing loss to the sum:
        ``router_aux_loss_coef`` times each row's loss (:func:`~toolkit.modules.moe.routing_statistics`) weighted by
        the row's trained tokens, so that divided by the global token count, as the cross-entropy sum is, it is the
        token-weighted mean of the rows' losses: for one row exactly ``transformers``' ``aux_loss`` term, and the same
        total whatever the split of a global batch into ranks and micro-batches.
        """
        h = self.final_hidden(tokens, mask=mask, input_pos=input_pos)
        if return_hidden:
            return h
        if num_output_chunks is not None and num_output_chunks < 1:
            raise ValueError(f"num_output_chunks must be at least 1, got {num_output_chunks}")
        if labels is not None:
            loss = self._loss_sum(h, labels, num_chunks=num_output_chunks or 1, fused=fused_loss,
                                  per_sequence=per_sequence)
            if distill is not None:
                return loss, self._distill_sum(h, labels, distill, num_chunks=num_output_chunks or 1)
            if self._moe_blocks and self.training and torch.is_grad_enabled():
                if not per_sequence:
                    loss = loss + self._router_loss_sum(labels, lengths)
                else:  # a per-row loss sums its own: the caller takes it (take_router_loss)
                    self._router_loss = self._router_loss_sum(labels, lengths, per_token=False)
            return loss
        if num_output_chunks is None:
            return self.compute_logits(h)
        return self._chunked_logits(h, num_output_chunks)

    def final_hidden(
        self, tokens: torch.Tensor, *, mask: torch.Tensor | None = None, input_pos: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The final hidden states ``[b, s, d]`` (embedding, layers, final norm) that the output projection and the
        losses take; a decoder whose layers are another library's overrides this and keeps the losses."""
        h = self.embed_tokens(tokens)  # [b, s, d]
        for layer in self.layers:
            layer_mask = mask.for_layer(layer.self_attn) if isinstance(mask, DocumentMasks) else mask
            h = layer(h, mask=layer_mask, input_pos=input_pos)
        return self.norm(h)

    def _router_loss_sum(
        self, labels: torch.Tensor, lengths: torch.Tensor | None, *, per_token: bool = True
    ) -> torch.Tensor:
        # The routers' load-balancing loss, weighted per row by its trained tokens (per_token: for a loss summed
        # over tokens) or not (for one summed over rows), and what it and the per-expert token counts add to the
        # totals the trainer takes after the step.
        stats = routing_statistics(
            [block.routing for block in self._moe_blocks], num_experts=self._moe_blocks[0].num_experts,
            lengths=lengths,
        )
        for block in self._moe_blocks:
            block.routing = None  # the loss's graph keeps what it needs
        weights = (labels != CROSS_ENTROPY_IGNORE_INDEX).sum(dim=-1).float() if per_token else 1.0  # [b]
        loss = self.router_aux_loss_coef * (stats.aux_loss * weights).sum()
        totals = {"aux_loss_sum": loss.detach().double(), "tokens_per_expert": stats.tokens_per_expert.double()}
        if self._routing_totals is not None:
            totals = {key: total + self._routing_totals[key] for key, total in totals.items()}
        self._routing_totals = totals
        return loss

    def take_router_loss(self) -> torch.Tensor | None:
        """The load-balancing loss of the last training forward with ``per_sequence`` (then reset):
        ``router_aux_loss_coef`` times the sum of its rows' losses, with its gradient, for the caller to add to its
        per-row loss (the preference step: as a mean over the rows of the global batch). None without
        mixture-of-experts layers or such a forward."""
        loss, self._router_loss = self._router_loss, None
        return loss

    def take_routing_totals(self) -> dict[str, torch.Tensor] | None:
        """What the routers did in the training forwards since the last call (then reset), float64:
        ``aux_loss_sum``, the load-balancing loss as those forwards added it to the loss sum, and
        ``tokens_per_expert`` ``[moe_layers, num_experts]``, the assignments each expert got. ``None`` without
        mixture-of-experts layers or such forwards."""
        totals, self._routing_totals = self._routing_totals, None
        return totals

    def _chunked_logits(self, h: torch.Tensor, num_chunks: int) -> list[torch.Tensor]:
        # Each chunk is a strided view of h; copied to one block, its projection is one matrix multiply instead of a
        # batched one per row (measured 10% faster on CPU for the demo's output layer, forward and backward).
        return [self.compute_logits(chunk.contiguous()) for chunk in h.tensor_split(num_chunks, dim=1)]

    def _loss_sum(
        self, h: torch.Tensor, labels: torch.Tensor, *, num_chunks: int, fused: bool, per_sequence: bool = False
    ) -> torch.Tensor:
        weight = self.fused_loss_weight() if fused else None
        if weight is None:
            chunks = self._chunked_logits(h, num_chunks)
            return chunked_sequence_logprobs(chunks, labels) if per_sequence else chunked_cross_entropy_sum(chunks, labels)
        adapter, output = None, self.output_projection()
        if isinstance(output, LoRALinear) and not output.disabled:
            # Dropout once over the whole h, as LoRALinear.forward applies it: the same mask for the same seed.
            adapter = LoRAAdapter(
                lora_a=output.lora_a.weight, lora_b=output.lora_b.weight, scale=output.scale, x=output.dropout(h)
            )
        if per_sequence:
            return linear_sequence_logprobs(
                h, weight, labels, adapter=adapter, softcap=self.final_logit_softcap, kernel=self.output_loss_kernel
            )
        return linear_cross_entropy_sum(
            h, weight, labels, adapter=adapter, num_chunks=num_chunks, softcap=self.final_logit_softcap,
            kernel=self.output_loss_kernel,
        )

    def distill_weight(self) -> torch.Tensor | None:
        """The output weight distillation projects with (as student or teacher): a tied embedding or a plain
        bias-free ``nn.Linear`` holding plain tensors (under tensor parallelism, DTensors split over the
        vocabulary). None for an adapter on the output layer or an NF4 or float8 weight."""
        weight, output = self.fused_loss_weight(), self.output_projection()
        return weight if output is None or type(output) is nn.Linear else None

    def _distill_sum(self, h: torch.Tensor, labels: torch.Tensor, targets: DistillTargets, *, num_chunks: int):
        weight = self.distill_weight()
        if weight is None:
            raise ValueError("distillation needs a plain output projection (no adapter, NF4 or float8 weight)")
        keep = labels != CROSS_ENTROPY_IGNORE_INDEX
        return linear_distillation_sum(
            h[keep], weight, targets.hidden[keep], targets.weight, kind=targets.kind, temperature=targets.temperature,
            beta=targets.beta, num_chunks=num_chunks, student_softcap=self.final_logit_softcap,
            teacher_softcap=targets.softcap,
        )

    def fused_loss_weight(self) -> torch.Tensor | None:
        """The weight the fused projection and loss project with, when they can take the output layer: a tied
        embedding, a plain bias-free ``nn.Linear``, or a bias-free :class:`~toolkit.modules.peft.LoRALinear` (its
        frozen base weight; the adapter, unless disabled, is added to the logits), each holding plain tensors. None
        for anything else (DoRA, an NF4 base, a bias, a float8 weight): those take the chunked logits."""
        output = self.output_projection()
        if output is None:
            tensors = [self.token_embedding().weight]
        elif type(output) is nn.Linear and output.bias is None:
            tensors = [output.weight]
        elif type(output) is LoRALinear and output.bias is None:  # exactly: DoRA rescales the adapted weight's rows
            tensors = [output.weight]
            if not output.disabled:
                tensors += [output.lora_a.weight, output.lora_b.weight]
        else:
            return None
        # Plain data only: not float8 or NF4 (QLoRA). Under FSDP2 they are the plain unsharded ones in forward; under
        # tensor parallelism, DTensors holding this rank's vocabulary rows (the loss is then vocabulary-parallel).
        return tensors[0] if all(type(_local(t)) in (torch.Tensor, nn.Parameter) for t in tensors) else None

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The output projection: final hidden states ``[..., d]`` to logits ``[..., vocab]``.

        A subclass that transforms the logits (soft-capping) should override this rather than ``forward``, so that
        the chunked output gets the transform too. The fused loss does not call it: it computes the plain
        projection, soft-capped by ``final_logit_softcap``, so a subclass with any other transform must also make
        :meth:`fused_loss_weight` return None.
        """
        output = self.output_projection()
        if output is None:
            weight = self.token_embedding().weight
            if isinstance(weight, DTensor):
                # Tied to a vocabulary-parallel embedding (tensor parallelism): each rank projects onto its rows of
                # the vocabulary, and the logits are gathered. (An untied output layer gathers them itself.)
                h = DTensor.from_local(h, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim, run_check=False)
                return F.linear(h, weight).full_tensor()
            return F.linear(h, weight)
        return output(h)

    def setup_caches(self, *, batch_size: int, max_seq_len: int | None = None, dtype: torch.dtype | None = None) -> None:
        """Give every attention layer a KV cache for incremental decoding.

        Each cache holds as many key/value heads as its layer computes: all of them, or under tensor parallelism this
        rank's share (it takes its shape from the first keys stored). The cache's ``dtype`` defaults to that of the
        keys and values the layers will compute: autocast's when it is on here (mixed precision: float32 weights,
        bfloat16 keys), else the weights'.
        """
        weight = self.token_embedding().weight
        if dtype is None and torch.is_autocast_enabled(weight.device.type):
            dtype = torch.get_autocast_dtype(weight.device.type)
        for layer in self.decoder_layers().values():
            attn = layer.self_attn
            attn.kv_cache = KVCache(
                batch_size=batch_size,
                num_kv_heads=None,
                head_dim=attn.head_dim,
                max_seq_len=max_seq_len or self.max_seq_len,
                dtype=dtype or weight.dtype,
                device=weight.device,
            )

    def clear_caches(self) -> None:
        """Remove the KV caches (training must not run with them)."""
        for layer in self.decoder_layers().values():
            layer.self_attn.kv_cache = None
