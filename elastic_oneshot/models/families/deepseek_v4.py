"""DeepSeek-V4: its decoder hands every layer the token ids, by which its first layers route tokens to experts (a
fixed table from token id to experts, `hash_moe`), and its hidden states are `hc_mult` streams of the hidden size
([batch, seq, hc_mult, hidden]). The token ids ride with the hidden states (riders.py): each layer takes them and
passes them on. Without them its hash-routed layers would see the token ids of the batch the keyword arguments are
built from (all zeros)."""

import torch

from elastic_oneshot.models import riders
from elastic_oneshot.models.family import Family, register


@register("deepseek_v4")
class DeepseekV4(Family):
    carried = ("input_ids",)

    def stream(self, hidden: torch.Tensor, calls: list[dict]) -> torch.Tensor:
        return riders.pack(hidden, [calls[0]["input_ids"]])

    def ride(self, layer: torch.nn.Module, index: int):
        streams = (layer.attn_hc.hc_mult, layer.input_layernorm.weight.shape[-1])

        def take(x: torch.Tensor, kwargs: dict):
            hidden, ids = riders.unpack(x, [(x.dtype, streams), (torch.int64, ())])
            return hidden, {"input_ids": ids}, ids

        riders.ride(layer, take, lambda output, kwargs, ids: riders.pack(output, [ids]))
