"""Tiny real transformers models and a real tokenizer, built locally (no hub)."""

import functools
import itertools
import json
import os

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from elastic_oneshot.loop.data import builtin_texts

CONFIGS = {
    "llama": lambda v: transformers.LlamaConfig(
        vocab_size=v, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False),
    "mistral": lambda v: transformers.MistralConfig(
        vocab_size=v, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        sliding_window=None),
    "qwen2": lambda v: transformers.Qwen2Config(
        vocab_size=v, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True),
    "qwen3": lambda v: transformers.Qwen3Config(
        vocab_size=v, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=512, tie_word_embeddings=True),
}


# Every decoder of the sweep at one tiny size: 2 layers, hidden 64, 4 heads (2 for keys and values) of 16; for
# mixtures, 4 experts, 2 per token, with every layer sparse. Each config class takes the names it knows.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
TINY_MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=0, n_group=1,
                topk_group=1, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
TINY_TYPE = {  # what a type needs besides: sizes it derives differently, or layouts to keep small
    **{t: dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
               v_head_dim=16) for t in ("deepseek_v3", "glm4_moe_lite")},  # multi-head latent attention
    "glm4_moe": dict(partial_rotary_factor=0.5),
    # experts of intermediate_size: kept equal to the moe_intermediate_size that every mixture here is given, which
    # llmcompressor's linearization reads where present
    **{t: dict(intermediate_size=32) for t in ("mixtral", "phimoe", "granitemoe", "gpt_oss")},
    "falcon_h1": dict(mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=32),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
    # hybrids of mamba and attention layers, one of each
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], mamba_n_heads=8, mamba_d_head=16,
                             mamba_d_state=16, mamba_chunk_size=32),
    "nemotron_h": dict(layer_types=["linear_attention", "moe", "full_attention", "mlp"], mamba_num_heads=8,
                       mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=32,
                       moe_shared_expert_intermediate_size=32),
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                  mamba_chunk_size=32),
    # issue 45's types (tests/test_reach.py)
    **{t: dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
               v_head_dim=16) for t in ("minicpm3",)},
    "glm_moe_dsa": dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
                        qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=2,
                        indexer_types=["full", "shared"]),  # the second layer reuses the first's top-k
    "deepseek_v4": dict(num_key_value_heads=1, q_lora_rank=32, o_lora_rank=32, o_groups=2, partial_rotary_factor=0.5,
                        index_topk=8, index_head_dim=16, index_n_heads=2, mlp_layer_types=["hash_moe", "moe"],
                        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}),
    "kimi_linear": dict(num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                        v_head_dim=16, linear_head_dim=32, linear_num_heads=2,
                        layer_types=["linear_attention", "full_attention"]),
    "gptj": dict(rotary_dim=8),
    "granitemoeshared": dict(intermediate_size=32, shared_intermediate_size=32),
    # Gemma 4: per-layer inputs of 32, and the last two of four layers reading the keys and values of the first two
    "gemma4_text": dict(num_hidden_layers=4, hidden_size_per_layer_input=32, vocab_size_per_layer_input=512,
                        global_head_dim=16, num_kv_shared_layers=2, sliding_window=16,
                        layer_types=["sliding_attention", "full_attention"] * 2, num_experts=4, top_k_experts=2,
                        moe_intermediate_size=32),
}


def make_tiny(path: str, model_type: str, moe: bool = False, seed: int = 0, attention: bool = True) -> str:
    """Save a tiny random model of any transformers `model_type` (its config class's defaults, at the sweep's
    size) with the tokenizer; weights drawn as in `make_model`, so that layers differ. `attention=False` zeroes
    o_proj, so that attention adds nothing."""
    tokenizer = _shared_tokenizer()
    sizes = {**TINY, **(TINY_MOE if moe else {}), **TINY_TYPE.get(model_type, {})}
    config = transformers.AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **sizes)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.normal_(0, 0.08 if attention or "o_proj" not in name else 0.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# Multimodal types at the sweep's text size, with a one-layer vision tower of width 32; image token ids at the top of
# the vocabulary.
VISION = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1, depth=1, num_heads=2)
MULTIMODAL = {
    "qwen2_5_vl": dict(vision=dict(out_hidden_size=64, fullatt_block_indexes=[0], window_size=28, patch_size=14),
                       top=dict(image_token_id=509, video_token_id=508, vision_start_token_id=507),
                       text=dict(rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                  "rope_theta": 10000.0})),
    "gemma3": dict(vision=dict(image_size=32, patch_size=16, vision_use_head=False),
                   top=dict(mm_tokens_per_image=4, image_token_index=509, boi_token_index=508, eoi_token_index=507),
                   text={}),
    "llama4": dict(vision=dict(image_size=28, patch_size=14, vision_output_dim=64, projector_input_dim=64,
                               projector_output_dim=64, intermediate_size=64),
                   top=dict(image_token_index=509, boi_token_index=508, eoi_token_index=507),
                   text=dict(num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1,
                             intermediate_size=32, intermediate_size_mlp=128, moe_layers=[0, 1],
                             attn_temperature_tuning=False, no_rope_layers=[1, 1], attention_chunk_size=64)),
}


def make_tiny_multimodal(path: str, model_type: str, seed: int = 0) -> str:
    """Save a tiny random image-text model of `model_type` (a MULTIMODAL key) with the tokenizer."""
    tokenizer = _shared_tokenizer()
    sizes = MULTIMODAL[model_type]
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.eos_token_id)
    config = transformers.AutoConfig.for_model(
        model_type, text_config={**TINY, "vocab_size": len(tokenizer), **ids, **sizes["text"]},
        vision_config={**VISION, **sizes["vision"]}, **sizes["top"])
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_tokenizer(vocab_size: int = 512) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE trained on the standard library's docstrings (about a second)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(itertools.islice(builtin_texts(), 600), trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def make_model(path: str, arch: str = "llama", seed: int = 0, dtype=torch.float32, **overrides):
    """Save a tiny randomly initialised `arch` model with its tokenizer to `path`."""
    tokenizer = make_tokenizer()
    config = CONFIGS[arch](len(tokenizer))
    for key, value in overrides.items():
        setattr(config, key, value)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Random init leaves near-identical activations; scale weights so layers actually differ.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@functools.cache
def _shared_tokenizer() -> transformers.PreTrainedTokenizerFast:
    return make_tokenizer()


def set_architecture(path: str, architecture: str):
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = [architecture]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def make_moe(path: str, experts: int = 8, layers: int = 2, seed: int = 0, hidden: int = 128, intermediate: int = 64,
             top_k: int = 2, attention: bool = True, scale: float = 0.08) -> str:
    """Save a tiny random Qwen3-MoE. `attention=False` zeroes o_proj, so that attention adds nothing."""
    tokenizer = make_tokenizer()
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=intermediate, num_experts=experts, num_experts_per_tok=top_k,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        max_position_embeddings=1024, tie_word_embeddings=True, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.normal_(0, scale if attention or "o_proj" not in name else 0.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
