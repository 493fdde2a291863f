"""GPT-2-style decoders whose layers are `transformer.h` (BLOOM, GPT-J, GPTBigCode/StarCoder), of Linear projections
(GPT-2's own are Conv1D, which no scheme here quantizes). BLOOM's and GPT-J's decoders unpack two values (hidden
states, attention weights) from every layer's call; GPTBigCode's takes the hidden states alone."""

import torch

from elastic_oneshot.models.family import Family, register


@register("bloom", "gptj")
class BlocksWithWeights(Family):
    stack = "h"
    layer_outputs = 2


@register("gpt_bigcode")
class GPTBigCode(Family):
    stack = "h"

    def default_ignores(self, skeleton: torch.nn.Module) -> list[str]:
        """Also the attention's and the MLP's output projections (`c_proj`): transformers' weight initialization of
        GPTBigCode reads their `weight` (GPT-2's scaled initialization) on every load, which a quantized Linear
        lacks, so a checkpoint with them quantized does not load."""
        return super().default_ignores(skeleton) + [n for n, m in skeleton.named_modules()
                                                    if n.endswith(".c_proj") and isinstance(m, torch.nn.Linear)]
