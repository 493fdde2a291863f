"""Helpers of the modifier parity tests (test_smoothing, test_awq, test_sparsegpt, test_rtn): a tiny Llama and its
calibration tokens, llmcompressor 0.14's oneshot run on them with any modifiers, and the inputs a decoder layer
sees when the layers before it are as a stage left them (the peer's independent pipeline: each modifier's pass
propagates through the layers it has already changed)."""

import contextlib

import pytest
import torch
import transformers

from elastic_oneshot.loop.data import calibration_samples

SAMPLES, SEQ_LEN = 8, 64


@pytest.fixture
def one_thread():
    """The peer and ours on one thread, where bits are compared (LAPACK and reductions split by thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load(path: str) -> transformers.PreTrainedModel:
    """Eager attention, so that a whole-model forward applies the causal mask as the peer's traced layers do."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def tokens(path: str) -> torch.Tensor:
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return calibration_samples("builtin", tokenizer, SAMPLES, SEQ_LEN, seed=0)


def run_peer(path: str, recipe, pin_memory: bool = True) -> transformers.PreTrainedModel:
    """The model after llmcompressor's oneshot with `recipe` (its default, independent pipeline) on `tokens`,
    visited in our order. Without `pin_memory` (a machine without an accelerator: AWQ pins its caches), pinning is a
    no-op."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.pipelines.cache import IntermediatesCache

    ids = tokens(path)
    # the peer visits samples in torch.argsort order of their (equal) lengths: order them so that it visits ours
    ids = ids[torch.argsort(torch.argsort(torch.tensor([SEQ_LEN] * len(ids)), descending=True))]
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = load(path)
    with contextlib.ExitStack() as stack:
        if not pin_memory:
            stack.enter_context(pytest.MonkeyPatch.context()).setattr(
                IntermediatesCache, "pin_memory", lambda self, *args, **kwargs: None)
        oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(ids), max_seq_length=SEQ_LEN,
                shuffle_calibration_samples=False)
    return model


class LayerInputs:
    """Forward hooks that record, for each sample, what chosen modules of one decoder layer take in (`inputs`, the
    positional input) and put out (`outputs`), and the keyword arguments the layer's parents are called with
    (`calls`: name -> per sample, to run that module again alone)."""

    def __init__(self, model, names: list[str], parents: list[str] = ()):
        self.inputs = {n: [] for n in names}
        self.outputs = {n: [] for n in names}
        self.calls = {p: [] for p in parents}
        modules = dict(model.named_modules())
        self.handles = [modules[n].register_forward_hook(self._hook(n)) for n in names]
        self.handles += [modules[p].register_forward_pre_hook(self._call(p), with_kwargs=True) for p in parents]

    def _hook(self, name):
        def hook(module, args, output):
            self.inputs[name].append(args[0].detach().clone())
            self.outputs[name].append((output[0] if isinstance(output, tuple) else output).detach().clone())
        return hook

    def _call(self, name):
        def hook(module, args, kwargs):
            import inspect

            bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
            bound |= bound.pop("kwargs", {})
            self.calls[name].append(bound)
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def record(model, ids: torch.Tensor, names: list[str], parents: list[str] = ()) -> LayerInputs:
    """Run the whole model on each sample alone (as the peer's batches of one) with hooks on `names`."""
    seen = LayerInputs(model, names, parents)
    try:
        for sample in ids:
            model(input_ids=sample[None], attention_mask=torch.ones_like(sample[None]), use_cache=False)
    finally:
        seen.remove()
    return seen
