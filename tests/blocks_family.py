"""The adapter of a made-up family (tests/test_families.py): a Llama whose decoder keeps its layers under `blocks`.
It is what adding a family takes: this one file, as elastic_oneshot/models/families/blocks_llama.py."""

from elastic_oneshot.models.family import Family, register


@register("blocks_llama")
class BlocksLlama(Family):
    stack = "blocks"
