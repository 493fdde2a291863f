"""GLM-MoE-DSA (GLM with DeepSeek sparse attention): every layer returns its hidden states and the top-k token
indices its indexer chose, and its decoder hands those to the next layer (`prev_topk_indices`), which reuses them
where the config makes it a "shared" layer (no indexer of its own). The indices ride with the hidden states
(riders.py) into each layer that reuses them."""

import torch

from elastic_oneshot.models import riders
from elastic_oneshot.models.family import Family, register


@register("glm_moe_dsa")
class GlmMoeDsa(Family):
    layer_outputs = 2
    carried = ("prev_topk_indices",)

    def ride(self, layer: torch.nn.Module, index: int):
        shared = [t == "shared" for t in layer.self_attn.config.indexer_types]
        takes, gives = shared[index], index + 1 < len(shared) and shared[index + 1]
        if not (takes or gives):
            return

        def take(x: torch.Tensor, kwargs: dict):
            if not takes:
                return x, {}, None
            hidden, indices = riders.unpack(x, [(x.dtype, (layer.hidden_size,)), (torch.int32, None)])
            return hidden, {"prev_topk_indices": indices}, None

        def give(output, kwargs: dict, _):
            hidden, indices = output
            return riders.pack(hidden, [indices.to(torch.int32)] if gives else []), indices

        riders.ride(layer, take, give)
