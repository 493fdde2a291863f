"""llmcompressor 0.14's oneshot on exactly our calibration tokens: the oracle of the parity tests and the
peer that bench/ times. llmcompressor is a test extra, so it is imported only when called."""

import torch
import transformers

from elastic_oneshot.loop.data import calibration_samples


def run_peer(model_dir: str, out: str, samples: int, seq_len: int, group_size: int = 128, moe: bool = False,
             scheme: str | dict | None = None, dataset: str = "builtin", dtype: str = "float32",
             all_experts: bool = True) -> str:
    """GPTQ with `scheme` written to `out`: a preset name (e.g. "FP8") on every Linear, a `config_groups` dict,
    or by default W4A16 (symmetric int4 groups of `group_size`); static activation order, damping 0.01, lm_head
    unquantized. With `moe`, the routers stay unquantized, as ours do, and every expert calibrates on every token
    (but on its routed tokens where not `all_experts`).
    The model loads in `dtype` ("auto": the checkpoint's)."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = calibration_samples(dataset, tokenizer, samples, seq_len, seed=0)
    # The peer visits samples in torch.argsort order of their (equal) lengths: order the dataset so that
    # it visits them as we do, since fp32 sums depend on the order.
    ids = ids[torch.argsort(torch.argsort(torch.tensor([seq_len] * samples), descending=True))]
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
    if isinstance(scheme, str):
        quantization = {"scheme": scheme, "targets": ["Linear"]}
    else:
        quantization = {"config_groups": scheme or {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size}}}}
    recipe = GPTQModifier(**quantization, ignore=["lm_head"] + (["re:.*mlp.gate$"] if moe else []),
                          actorder="static", dampening_frac=0.01, block_size=128)
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=samples, max_seq_length=seq_len,
            shuffle_calibration_samples=False, pipeline="sequential",
            **({"moe_calibrate_all_experts": all_experts} if moe else {}))
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    return out


def run_recipe(model_dir: str, out: str, samples: int, seq_len: int, recipe, moe: bool = False,
               dataset: str = "builtin", dtype: str = "float32") -> str:
    """llmcompressor 0.14's oneshot with `recipe` (its modifier objects) on our calibration tokens, in its default
    pipeline (independent: each modifier over every layer before the next), written as it writes it to `out`. With
    `moe`, every expert calibrates on every token. On a machine without an accelerator its AWQ pins its caches and
    fails: there, pinning is a no-op for the call. The model loads in `dtype` ("auto": the checkpoint's)."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.pipelines.cache import IntermediatesCache

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = calibration_samples(dataset, tokenizer, samples, seq_len, seed=0)
    ids = ids[torch.argsort(torch.argsort(torch.tensor([seq_len] * samples), descending=True))]  # as run_peer
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype if dtype == "auto" else getattr(torch, dtype), attn_implementation="eager")
    pin = IntermediatesCache.pin_memory
    if not torch.cuda.is_available():
        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    try:
        oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=samples, max_seq_length=seq_len,
                shuffle_calibration_samples=False, **({"moe_calibrate_all_experts": True} if moe else {}))
    finally:
        IntermediatesCache.pin_memory = pin
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    return out
