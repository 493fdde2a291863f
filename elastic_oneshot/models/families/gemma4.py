"""Gemma 4 (its language model; dense, or with the optional MoE block beside the MLP): its decoder hands each layer two
things besides the hidden states. Its per-layer input (`per_layer_input`, by position: that layer's slice of an
embedding of the tokens plus a projection of the embedded tokens, hidden_size_per_layer_input wide), which depends on
the tokens; and one dict (`shared_kv_states`) in which the last layer of each attention type before the KV-sharing
layers stores its keys and values, which the last `num_kv_shared_layers` layers read instead of computing their own.
Both ride with the hidden states (riders.py). Entering layer i: the hidden states, the per-layer inputs of layers i
to the last, then the keys and values of each attention type that a layer from i on reads (in the order they were
stored), each as [batch, seq, kv heads, head dim]."""

import torch

from elastic_oneshot.models import riders
from elastic_oneshot.models.family import Family, register


@register("gemma4_text", "gemma4")
class Gemma4(Family):
    carried = ("per_layer_input", "shared_kv_states")

    def stream(self, hidden: torch.Tensor, calls: list[dict]) -> torch.Tensor:
        return riders.pack(hidden, [c["per_layer_input"] for c in calls if c.get("per_layer_input") is not None])

    def ride(self, layer: torch.nn.Module, index: int):
        config, sharing = layer.config, _Sharing(layer.config)
        width, inputs = config.hidden_size, config.num_hidden_layers - index if config.hidden_size_per_layer_input \
            else 0
        kv_in, kv_out = sharing.read_from(index), sharing.read_from(index + 1)
        if not (inputs or kv_in or kv_out):
            return

        def take(x: torch.Tensor, kwargs: dict):
            layout = [(x.dtype, (width,))] + [(x.dtype, (config.hidden_size_per_layer_input,))] * inputs
            layout += [(x.dtype, sharing.shape(kind)) for kind in kv_in for _ in ("key", "value")]
            hidden, *per_layer = riders.unpack(x, layout)
            per_layer, kv = per_layer[:inputs], per_layer[inputs:]
            shared = {kind: (kv[2 * i].transpose(1, 2), kv[2 * i + 1].transpose(1, 2)) for i, kind in enumerate(kv_in)}
            return hidden, {"per_layer_input": per_layer[0] if per_layer else None, "shared_kv_states": shared}, \
                per_layer[1:]

        def give(output: torch.Tensor, kwargs: dict, later: list[torch.Tensor]) -> torch.Tensor:
            shared = kwargs["shared_kv_states"]  # with what this layer stored in it
            return riders.pack(output, later + [t.transpose(1, 2) for kind in kv_out for t in shared[kind]])

        riders.ride(layer, take, give)


class _Sharing:
    """Which layer stores the keys and values of each attention type, and which layers read them (as
    Gemma4TextAttention decides: the last layer of each type before the first of the sharing layers stores)."""

    def __init__(self, config):
        self.config, types = config, config.layer_types
        first = config.num_hidden_layers - (getattr(config, "num_kv_shared_layers", 0) or 0)
        self.stores = {kind: max(i for i in range(first) if types[i] == kind) for kind in set(types[:first])}
        self.readers = {kind: [j for j in range(first, config.num_hidden_layers) if types[j] == kind]
                        for kind in self.stores}

    def read_from(self, index: int) -> list[str]:
        """The attention types whose stored keys and values a layer from `index` on reads, stored before it."""
        return sorted((kind for kind, at in self.stores.items()
                       if at < index and any(j >= index for j in self.readers[kind])), key=self.stores.get)

    def shape(self, kind: str) -> tuple[int, int]:
        """The shape of the keys (and values) of `kind` per token: kv heads, head dim of the layer storing them."""
        stored = self.config.per_layer_config[self.stores[kind]]
        return stored.num_key_value_heads, stored.head_dim
