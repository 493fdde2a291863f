"""A made-up architecture, `blocks_llama` (tests/test_families.py): a Llama whose decoder keeps its layers under
`blocks`, registered with transformers as a new architecture's own code would register it. It imports nothing of
elastic_oneshot: a fresh interpreter runs it before loading a checkpoint of it, as a user's code would."""

import torch
import transformers
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast


class BlocksConfig(transformers.LlamaConfig):
    model_type = "blocks_llama"


class BlocksModel(transformers.LlamaModel):
    """LlamaModel with its decoder layers under `blocks`."""

    config_class = BlocksConfig

    def __init__(self, config):
        super().__init__(config)
        self.blocks = self.layers
        del self.layers

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if use_cache and past_key_values is None:
            past_key_values = transformers.DynamicCache(config=self.config)
        if position_ids is None:
            seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = (torch.arange(hidden.shape[1], device=hidden.device) + seen).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                  past_key_values=past_key_values, position_ids=position_ids)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        for block in self.blocks:
            hidden = block(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                           position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), past_key_values=past_key_values)


class BlocksForCausalLM(transformers.LlamaForCausalLM):
    config_class = BlocksConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = BlocksModel(config)
        self.post_init()


transformers.AutoConfig.register("blocks_llama", BlocksConfig, exist_ok=True)
transformers.AutoModelForCausalLM.register(BlocksConfig, BlocksForCausalLM, exist_ok=True)
