"""Tiny real transformers models and a real tokenizer, built locally (no hub)."""

import itertools
import json
import os

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..data import builtin_texts

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
