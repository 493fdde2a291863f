"""Llama 4 (the image-text model, or its language model alone): its experts container is one that transformers
does not declare (`use_experts_implementation`), so its layout is said here, and transformers' own quantized
loader builds it per expert."""

import torch
from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

from elastic_oneshot.models.family import Family, register
from elastic_oneshot.models.moe import Layout, default_gating


@register("llama4", "llama4_text")
class Llama4(Family):
    def experts(self, module: torch.nn.Module) -> Layout | None:
        """Llama4TextExperts: weights transposed (in, out), gate and up concatenated, default gating; called with
        the tokens repeated once per expert, each copy weighted by its routing score (Llama4TextMoe)."""
        if isinstance(module, Llama4TextExperts):
            return Layout(default_gating(module.act_fn), transposed=True, stacked=True)
        return super().experts(module)

    def teach_loader(self, skeleton: torch.nn.Module):
        """Nothing to teach: on a quantized load transformers replaces Llama4TextExperts by per-expert Linears
        itself (SequentialLlama4TextExperts)."""
