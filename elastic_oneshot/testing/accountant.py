"""One decoder layer of ours, or of llmcompressor 0.14's, on the fake accelerator of ledger.py: what a GPU would
hold and launch, counted on a CPU. bench/gpu.py --device cpu drives it.

Both sides get the same layer (a SHAPES config, weights in the model's dtype on the device), the same calibration
inputs (hidden states on the host, moved to the device a chunk of ours or a sample of the peer's at a time, as each
side moves them) and the same keyword arguments (computed by our Embedder from the config), W4A16 in groups of 128
with static activation order, eager attention, and every expert calibrated on every token. Each side then runs its
own per-layer steps, in its own order:

    ours   runner.py's process(): Calibration's hooks over this rank's chunks, one sample at a time (the Hessian
           sums in gptq.hessian_add and gptq.fold), Executor.run on a world of one (the column loop captured and
           replayed as a CUDA graph, as on a CUDA device), the compressed tensors of each solved group kept on the
           device, and propagation through the unpacked weights, a chunk at a time
    peer   its sequential pipeline for one subgraph: GPTQModifier's hooks over every sample (its
           accumulate_hessian), on_sequential_epoch_end (observers, then compress_modules in its batches, sized
           as "auto" sizes them on an 80 GB H100 with what the layer already holds), then the propagation pass

Phases: load, calibrate, Hessians (inside calibrate: the Hessian sums), GPTQ, propagate. Outside the ledger: the
host work that has no device counterpart (reading the config, the Embedder's kwargs on the host).
"""

import contextlib
import copy
import json
import os
import types
from unittest import mock

import torch
import transformers
from safetensors.torch import save_file

from elastic_oneshot.testing.gpu import SHAPES, TINY
from elastic_oneshot.testing.ledger import HOST, Ledger, accelerator, paper

VOCAB = 256  # the layer does not depend on it; the Embedder's table is read from disk
H100_BYTES = 80 * 10**9  # the peer's "auto" batches: 75 % of what is free on this
GROUP_SIZE = 128


def paper_model(path: str, name: str, tiny: bool = False) -> str:
    """A model directory for SHAPES[name] (or TINY's) with one decoder layer whose weights are not written: the
    config, and the tensors outside the layers (at a small vocabulary), which our Embedder reads. Kept if there."""
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    model_type, _, sizes = (TINY if tiny else SHAPES)[name]
    config = transformers.AutoConfig.for_model(model_type, num_hidden_layers=1, bos_token_id=1, eos_token_id=2,
                                               pad_token_id=2, **{**sizes, "vocab_size": VOCAB})
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    torch.manual_seed(0)
    outside = {k: (torch.randn(t.shape) * 0.02).to(t.dtype) for k, t in skeleton.state_dict().items()
               if ".layers." not in k}
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    save_file(outside, os.path.join(path, "model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(os.path.join(path, "model.safetensors.tmp"), os.path.join(path, "model.safetensors"))
    return path


def _on_device(module: torch.nn.Module, device) -> torch.nn.Module:
    """`module` with new (paper) tensors of its shapes and dtypes on `device`: allocations the ledger counts."""
    for m in module.modules():
        for name, p in m.named_parameters(recurse=False):
            m._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=False)
        for name, b in m.named_buffers(recurse=False):
            m._buffers[name] = torch.empty_like(b, device=device)
    return module


def _to_paper(ledger: Ledger, obj, device):
    """Host tensors (nested) as paper ones moved to `device`, integer ones with their values."""
    if isinstance(obj, torch.Tensor):
        return ledger.paper(obj, HOST, value=not obj.is_floating_point()).to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_paper(ledger, o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_paper(ledger, v, device) for k, v in obj.items()}
    return obj


@contextlib.contextmanager
def _hessian_phase(ledger: Ledger, module, *names):
    """Inside, module's functions `names` run in the ledger's "Hessians" phase."""
    def wrap(f):
        def phased(*args, **kwargs):
            with ledger.phase("Hessians"):
                return f(*args, **kwargs)
        return phased
    with contextlib.ExitStack() as stack:
        for n in names:
            if hasattr(module, n):  # (an older build may lack one: bench/gpu.py --device cpu on a past commit)
                stack.enter_context(mock.patch.object(module, n, wrap(getattr(module, n))))
        yield


@contextlib.contextmanager
def _paper_graphs(ledger: Ledger):
    """Inside, GPTQ's column loop is captured and replayed as on a CUDA device (gptq._GraphedLoop), on paper: the
    capture runs the block's loop twice (its warm-up, then its recording, each op dispatched), and each replay is
    one launch of those kernels (Ledger.replay)."""
    from elastic_oneshot.quantization import gptq

    class PaperGraph(gptq._GraphedLoop):
        @classmethod
        def capture(cls, block: list, column_args):
            static = [None if t is None else t.clone() for t in block]
            for _ in range(2):
                gptq._column_loop(*static, column_args)
            return cls(static, column_args)

        def __call__(self, block: list):
            for mine, new in zip(self.static, block):
                if mine is not None:
                    mine.copy_(new)
            with ledger.replay():
                gptq._column_loop(*self.static, self.graph)
            return self.static[0], self.static[1]

    with mock.patch.object(gptq, "_GraphedLoop", PaperGraph), mock.patch.object(gptq, "_graphable", lambda w: True):
        yield


def _host_inputs(n: int, seq_len: int, hidden: int, dtype) -> torch.Tensor:
    return torch.empty(n, seq_len, hidden, dtype=dtype)  # paper, on the host


def ours(model_dir: str, samples: int, seq_len: int, ledger: Ledger, chunk_size: int = 8):
    """Our runner's steps for layer 0 of `model_dir` on the fake accelerator."""
    from elastic_oneshot.distributed.world import World
    from elastic_oneshot.loop.calibration import Calibration
    from elastic_oneshot.loop.data import chunk_bounds
    from elastic_oneshot.loop.layer_step import LayerStep
    from elastic_oneshot.models.moe import experts_mode
    from elastic_oneshot.models.source import Embedder, SourceModel
    from elastic_oneshot.quantization import gptq
    from elastic_oneshot.quantization.executor import Executor
    from elastic_oneshot.quantization.packing import LayerPacking, unpack_into
    from elastic_oneshot.quantization.plan import layer_groups, make_plan
    from elastic_oneshot.quantization.recipe import Recipe

    device = accelerator()
    source = SourceModel(model_dir)
    recipe = Recipe(group_size=GROUP_SIZE)
    schemes = recipe.module_schemes(source.skeleton, source.family)
    names = source.by_layer(list(schemes))[0]
    prefix = f"{source.layer_prefix}0."
    host_kwargs = Embedder(source).layer_kwargs(0, 1, seq_len)
    world = World()
    world.device = device
    chunks = chunk_bounds(samples, chunk_size)
    with paper(ledger), torch.inference_mode(), _paper_graphs(ledger), \
            _hessian_phase(ledger, gptq, "hessian_add", "hessian_add_batch", "fold"):
        inputs = [_host_inputs(b - a, seq_len, source.config.hidden_size, source.dtype) for a, b in chunks]
        with ledger.phase("load"):
            module = _on_device(copy.deepcopy(source.layers[0]), device)
            kwargs = _to_paper(ledger, host_kwargs, device)
        groups = layer_groups(module, names, source.family.input_key(True))
        packing = LayerPacking(schemes, prefix, dict(module.named_modules()), names, {},
                               source.family.fused_scales)
        with ledger.phase("calibrate"):
            calib = Calibration(module, [[n for n, _ in g.modules] for g in groups], device, seq_len,
                                {g.name: schemes[prefix + g.name] for g in groups})
            with experts_mode(module, True):
                for x in inputs:
                    for sample in x.to(device).split(1):
                        calib.run(module, sample, kwargs)
                    calib.end_chunk()
            calib.remove()
        with ledger.phase("GPTQ"):
            tensors = {}

            def persist(solved):  # the runner keeps them on the device and writes host copies
                packed = {k: v for g, w in solved for k, v in packing.pack(g, w).items()}
                tensors.update(packed)
                _ = {k: v.cpu() for k, v in packed.items()}

            executor = Executor(world, make_plan(groups, 1), groups, packing.weights, recipe, 0, persist,
                                packing.args, packing.qparams)
            executor.run(calib.hessian, samples, calib.ranges)
            del executor, calib
        with ledger.phase("propagate"):
            unpack_into(module, prefix, names, tensors, schemes)
            for x in inputs:
                LayerStep.forward(module, x.to(device), kwargs).cpu()


def _meta_model(config) -> transformers.PreTrainedModel:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="eager")


def _peer_recipe(modifier, moe: bool):
    """The W4A16 recipe both sides run, in the peer's terms."""
    return modifier(config_groups={"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP_SIZE}}},
        ignore=["lm_head"] + (["re:.*mlp.gate$"] if moe else []), actorder="static", dampening_frac=0.01,
        block_size=128)


def peer(model_dir: str, samples: int, seq_len: int, ledger: Ledger):
    """llmcompressor 0.14's steps for layer 0 of `model_dir` on the fake accelerator."""
    from compressed_tensors.offload.module import remove_module_offload
    from llmcompressor.core import State
    from llmcompressor.modeling.moe.context import moe_calibration_context
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from llmcompressor.modifiers.gptq import GPTQModifier, base, helpers
    from llmcompressor.modifiers.utils.hooks import HooksMixin
    from llmcompressor.utils import metric_logging
    from llmcompressor.utils.helpers import DisableQuantization, calibration_forward_context

    from elastic_oneshot.models.source import Embedder, SourceModel

    device = accelerator()
    config = transformers.AutoConfig.from_pretrained(model_dir)
    moe = "moe" in config.model_type
    host_kwargs = Embedder(SourceModel(model_dir)).layer_kwargs(0, 1, seq_len)
    model, recipe = _meta_model(config), _peer_recipe(GPTQModifier, moe)
    auto_batches = helpers.max_batch_size

    def on_an_h100(module, batched_quantization, block_size):  # "auto", as the peer sizes it on a GPU
        free = H100_BYTES - ledger.live
        with mock.patch.object(helpers, "get_execution_device", lambda m: torch.device("cuda")), \
                mock.patch.object(torch.accelerator, "is_available", lambda: True), \
                mock.patch.object(torch, "get_device_module", lambda *a: types.SimpleNamespace(
                    mem_get_info=lambda *d: (free, H100_BYTES))):
            return auto_batches(module, batched_quantization, block_size)

    with paper(ledger), _hessian_phase(ledger, base, "accumulate_hessian"), \
            mock.patch.object(helpers, "max_batch_size", on_an_h100), \
            mock.patch.object(metric_logging, "_get_visible_devices", lambda: []), contextlib.ExitStack() as stack:
        if moe:
            stack.enter_context(moe_calibration_context())
        layer = model.model.layers[0]
        hidden = _host_inputs(samples, seq_len, config.hidden_size, torch.bfloat16)
        if moe:  # linearized on the host as it loads (offloaded to the host, as it leaves them), then onloaded
            _on_device(layer, HOST)
            linearize_moe(model)
            for m in layer.modules():
                remove_module_offload(m)
        with ledger.phase("load"):
            _on_device(layer, device)
            kwargs = _to_paper(ledger, host_kwargs, device)
        state = State(model=model)
        recipe.on_initialize(state)
        recipe.on_calibration_start(state, None)
        stack.enter_context(calibration_forward_context(model))
        stack.enter_context(DisableQuantization(model))
        with ledger.phase("calibrate"):
            for i in range(samples):
                layer(hidden[i:i + 1].to(device), **kwargs)
        with ledger.phase("GPTQ"):
            recipe.on_sequential_epoch_end(state, None, list(layer.modules()))
        with ledger.phase("propagate"), HooksMixin.disable_hooks():
            for i in range(samples):
                out = layer(hidden[i:i + 1].to(device), **kwargs)
                (out[0] if isinstance(out, tuple) else out).cpu()
        recipe.on_calibration_end(state, None)


def account(side: str, model_dir: str, samples: int, seq_len: int, sites: bool = False) -> dict:
    """One side's layer on the fake accelerator: Ledger.report(), with the operations counted most, by name."""
    ledger = Ledger(sites=sites)
    (ours if side == "ours" else peer)(model_dir, samples, seq_len, ledger)
    return ledger.report() | {"ops_by_name": ledger.by_op.most_common(12)}


def main(argv: list[str]) -> int:
    """python -m elastic_oneshot.testing.accountant SIDE MODEL_DIR SAMPLES SEQ_LEN REPORT.json [sites]: one
    side in a process of its own (the fake backend and the peer's patches stay in it)."""
    side, model_dir, samples, seq_len, report, *more = argv
    result = account(side, model_dir, int(samples), int(seq_len), sites="sites" in more)
    with open(report + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(report + ".tmp", report)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
