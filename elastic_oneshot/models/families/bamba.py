"""Bamba: its decoder unpacks two values (hidden states, attention weights) from every layer's call."""

from elastic_oneshot.models.family import Family, register


@register("bamba")
class Bamba(Family):
    layer_outputs = 2
