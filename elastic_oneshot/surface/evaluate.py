"""Perplexity over held-out samples (blocks the calibration never draws from)."""

import math

import torch
import transformers

from elastic_oneshot.errors import UsageError
from elastic_oneshot.loop.data import heldout_samples
from elastic_oneshot.models.source import teach_transformers
from elastic_oneshot.quantization.schemes import load_dtype


@torch.inference_mode()
def perplexity(model_dir: str, dataset: str = "builtin", num_samples: int = 16, seq_len: int = 512,
               text_column: str = "text", batch_size: int = 4) -> float:
    try:
        teach_transformers(model_dir)  # a checkpoint of ours whose experts transformers knows only fused
    except UsageError:
        pass  # a model we do not compress: transformers loads it as it is
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        dtype = load_dtype(transformers.AutoConfig.from_pretrained(model_dir).to_dict().get("quantization_config"))
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, output_loading_info=True, **({"dtype": dtype} if dtype else {}))
        model.eval()
    except OSError as e:
        raise UsageError(f"cannot load {model_dir}: {str(e).splitlines()[0]}") from None
    if missing := info["missing_keys"]:  # transformers only reports them: their weights would be random
        shown = ", ".join(sorted(missing)[:4]) + (" ..." if len(missing) > 4 else "")
        raise UsageError(f"transformers loads {model_dir} with {len(missing)} tensors missing ({shown}): its "
                         "perplexity would be a random model's")
    ids = heldout_samples(dataset, tokenizer, num_samples, seq_len, text_column)
    total, count = 0.0, 0
    for batch in ids.split(batch_size):
        logits = model(input_ids=batch).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total += nll.item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)

