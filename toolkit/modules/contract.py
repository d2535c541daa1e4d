"""The model contract: the parts of a model that the engine works on, asked of the model instead of read from its
attributes.

FSDP2 units, activation checkpointing and offloading, compile, the tensor-parallel plan, generation's KV caches and
the memory plan all work layer by layer, and the tensor-parallel plan and the memory plan also treat the token
embedding, the final norm and the output projection apart. They used to read ``model.layers``,
``model.embed_tokens``, ``model.norm`` and ``model.output``, which only one text decoder has under those names: a
vision encoder in front of the decoder, a ``transformers`` model (its layers are ``model.layers``, its head
``lm_head``) or a pipeline stage holding layers 16..31 broke every one of them. Each now asks the model through
:class:`DecoderModel`; a new kind of model implements its four methods and no caller changes.

Why methods on the model rather than accessor functions over it: only the model knows where its parts are. An
accessor function would either read fixed attribute names (the problem above) or switch on the model's type (a
registry to keep in sync). A :class:`typing.Protocol` states the methods without a base class (composition over
inheritance), and being ``runtime_checkable`` lets a test, or a caller that also takes other modules, check a model
with ``isinstance``.

Why :meth:`DecoderModel.decoder_layers` maps module paths to layers: a path (``layers.16``, or ``model.layers.16``
for the ``transformers`` backend) is the prefix of the layer's parameter names, so plans and logs can name it, and a
wrapper that must replace the layer rather than change it in place (``checkpoint_wrapper``) does so with
``model.set_submodule(path, wrapped)`` whatever container holds it. Under that path a layer keeps the index it has in
the whole model: :class:`DecoderLayers` is the container that keeps it.
"""

from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class DecoderModel(Protocol):
    """What the engine asks of a model: its decoder layers, token embedding, final norm and output projection.

    :class:`~toolkit.modules.TransformerDecoder` implements it over its own modules, the ``transformers`` backend over
    the Hugging Face model's. A model with an encoder in front of the decoder implements it over the decoder's parts
    (the encoder is then part of the root, which FSDP2 shards as one unit and the memory plan counts as such); a
    pipeline stage reports the layers it holds, under their names in the whole model.
    """

    def decoder_layers(self) -> dict[str, nn.Module]:
        """The decoder layers this model holds, in the order they run, by their module path in the model (the
        prefix of their parameters' names: ``{"layers.0": ..., "layers.1": ...}``). A new dict each call: replace a
        layer with ``model.set_submodule(path, new_layer)``."""
        ...

    def token_embedding(self) -> nn.Embedding:
        """The token embedding: ``[vocab, d]`` rows looked up by token id."""
        ...

    def final_norm(self) -> nn.Module:
        """The norm between the last decoder layer and the output projection."""
        ...

    def output_projection(self) -> nn.Module | None:
        """The projection from the final hidden states to the vocabulary's logits; None when it is the token
        embedding's weight (tied)."""
        ...


class DecoderLayers(nn.Module):
    """A model's decoder layers, each registered under its index in the whole model (``"0"``, ``"1"``, ...), so that
    a model holding only some of them (a pipeline stage with layers 16..31) still names them ``layers.16...`` and its
    state-dict keys are the whole model's.

    The names are those ``nn.ModuleList`` gives a whole model, so state-dict keys (``layers.0.self_attn.q_proj.
    weight``), checkpoints and weight-name conversions are unchanged. Unlike ``nn.ModuleList``, deleting a layer does
    not rename the ones after it. Unlike ``nn.ModuleDict`` (torchtitan's choice), iterating yields the layers, not
    their keys, so ``for layer in model.layers`` in the model's own code keeps meaning what it says, and an integer
    index is accepted: ``layers[3]`` and ``layers["3"]`` are both the layer whose index in the whole model is 3 (for
    a whole model, the fourth, as in a list; a stage without it raises ``KeyError`` rather than giving another).

    Layers are replaced in place (``layers["3"] = wrapped``, or ``model.set_submodule("layers.3", wrapped)``), keeping
    their place in the order, and removed with ``del``; a model is not grown layer by layer, so there is no append.

    Args:
        layers: the layers in order, numbered from 0 (a whole model); or a mapping from each layer's index in the
            whole model, as a string, to the layer, in ascending order (a stage: ``{"16": ..., "17": ...}``).

    Raises:
        ValueError: a key that is not a non-negative integer written in decimal, or keys out of ascending order.
    """

    def __init__(self, layers: Iterable[nn.Module] | Mapping[str, nn.Module]) -> None:
        super().__init__()
        named = layers.items() if isinstance(layers, Mapping) else ((str(i), layer) for i, layer in enumerate(layers))
        previous = -1
        for key, layer in named:
            # str(int(key)) == key refuses "007" and "+1": another spelling of an index would be another name.
            if not (isinstance(key, str) and key.isdecimal() and str(int(key)) == key and int(key) > previous):
                raise ValueError(
                    f"decoder layer keys must be the layers' indices in the whole model, ascending; got {key!r} "
                    f"after {previous}"
                )
            previous = int(key)
            self.add_module(key, layer)

    def _name(self, key: str | int) -> str:
        name = str(key) if isinstance(key, int) and not isinstance(key, bool) else key
        if not isinstance(name, str) or name not in self._modules:
            raise KeyError(f"no decoder layer {key!r} here; this model holds layers {self._held()}")
        return name

    def _held(self) -> str:
        names = list(self._modules)
        return ", ".join(names) if len(names) <= 4 else f"{names[0]}..{names[-1]} ({len(names)} layers)"

    def __getitem__(self, key: str | int) -> nn.Module:
        return self._modules[self._name(key)]

    def __setitem__(self, key: str | int, layer: nn.Module) -> None:
        self.add_module(self._name(key), layer)  # the key exists: the dict keeps its place in the order

    def __delitem__(self, key: str | int) -> None:
        del self._modules[self._name(key)]

    def __contains__(self, key: object) -> bool:
        # Without it, ``in`` would compare the key with each layer (what iterating yields) and always be False.
        name = str(key) if isinstance(key, int) and not isinstance(key, bool) else key
        return isinstance(name, str) and name in self._modules

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())
