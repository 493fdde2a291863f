"""Nemotron-H: its decoder reads each layer's `block_type` (mamba, attention, moe, mlp) to pick the layer's mask.
Its experts have no gate (down(act(up(x)))), which the generic adapter splits per expert as transformers declares
them, under the checkpoint's names (`mixer.experts.N.up_proj`), which vLLM reads."""

import torch

from elastic_oneshot.models.family import Family, register


@register("nemotron_h")
class NemotronH(Family):
    def layer_attributes(self, layer: torch.nn.Module) -> dict:
        return {**super().layer_attributes(layer), "block_type": layer.block_type}
