"""Round to nearest with a scheme's observers: llmcompressor's QuantizationModifier (no Hessian, no calibration
of weights), and the quantizer that AWQ's grid search evaluates. Pure math: no I/O, no processes.

The qparams are gptq.module_qparams' (the peer's memoryless min-max observer on the weight as given, NVFP4's global
scale over the family's fusion group); the codes are the compressor's own rounding of that weight, so they equal
the peer's, which compresses the module's unmodified weight with the observed qparams.
"""

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization import fake_quantize as ct_fake_quantize

from elastic_oneshot.quantization.gptq import QParams, module_qparams
from elastic_oneshot.quantization.packing import compress_module


class _Held(torch.nn.Module):
    """A weight in the shape gptq.module_qparams reads (a module's `weight`)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight


def qparams(weights: dict[str, torch.Tensor], args: dict[str, QuantizationArgs],
            fused_scales: tuple[tuple[str, ...], ...]) -> dict[str, QParams]:
    """Each weight's qparams as the peer's observer gives them (`weights`, `args`: by module name within a layer;
    siblings of a fusion group among them share a global scale)."""
    return module_qparams({name: _Held(w) for name, w in weights.items()}, args, fused_scales)


def fake_quantize(weight: torch.Tensor, q: QParams, args: QuantizationArgs) -> torch.Tensor:
    """The weight quantized and dequantized with its qparams, as the peer's forward_quantize of a weight."""
    return ct_fake_quantize(weight, q.scale, None if args.symmetric else q.zero_point, args,
                            global_scale=q.global_scale)


def compress(weights: dict[str, torch.Tensor], schemes: dict[str, QuantizationScheme],
             fused_scales: tuple[tuple[str, ...], ...], inputs: dict[str, dict] | None = None,
             only: list[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """QuantizationModifier's result for a layer's quantized modules (`weights`: as the stages before it left them,
    by name within the layer): each module's compressed tensors by local name (packing.compress_module), with its
    static input activations' (`inputs`: by module, e.g. input_scale) where calibrated. `only`: the modules to
    compress (a rank's share), their qparams still observed with all of `weights` (a fusion group's global scale)."""
    q = qparams(weights, {name: s.weights for name, s in schemes.items()}, fused_scales)
    inputs = inputs or {}
    return {name: compress_module(w, q[name], dict(inputs.get(name, {})), schemes[name]) for name, w in weights.items()
            if only is None or name in only}
