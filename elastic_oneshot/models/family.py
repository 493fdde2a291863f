"""What elastic-oneshot needs to know of a model family, declared in one place.

A family says which Auto class builds the whole model (a causal LM, or an image-text model with a language model
inside); where the language model's decoder and its stack of layers are, and what the decoder's forward reads off a
layer; which modules are fused experts containers and in which layout they become per-expert Linears (moe.Layout),
and which are left fused (kept dense, with a warning); how the skeleton's tensor names become the checkpoint's, and
what transformers must be taught to load per-expert weights back; which sibling Linears read one input (one Hessian)
and which share a fused scale (NVFP4's global scale); and which Linears stay dense whatever the recipe targets.

`Family` is the generic adapter: it reads what transformers declares and probes what it does not, here and nowhere
else. A family that needs its own answers is one file in models/families/ (each imported on the first lookup): a
subclass of `Family` registered for its config's model_type with `@register`, found by `family_for(config)`. The
idea is llm-compressor's registered MoE calibration modules and torchtitan's per-family state-dict adapters.
"""

import copy
import functools
import importlib
import pkgutil
import re
from collections.abc import Callable, Hashable

import torch
import transformers

from elastic_oneshot.models import mappings, stored_names
from elastic_oneshot.models.moe import Experts, Layout, default_gating, own_gating

FAMILIES: dict[str, type["Family"]] = {}
EXPERT = re.compile(r"((?:.*\.)?experts)\.(\d+)\.(\w+)$")  # an expert's Linear, as moe.make_quantizable names it
# config names of experts per token
TOP_K = ("num_experts_per_tok", "moe_top_k", "top_k", "num_selected_experts", "top_k_experts")


def register(*model_types: str):
    """Class decorator: the adapter of the models whose config (or text config) has one of `model_types`."""
    def add(cls: type["Family"]) -> type["Family"]:
        FAMILIES.update(dict.fromkeys(model_types, cls))
        return cls
    return add


def family_for(config) -> "Family":
    """The adapter registered for `config`'s model_type, else for its text model's (in an image-text wrapper),
    else the generic one."""
    _discover()
    adapter = FAMILIES.get(config.model_type) or FAMILIES.get(config.get_text_config().model_type, Family)
    return adapter()


@functools.cache
def _discover():
    """Import every module of models/families/ once: each registers its adapter."""
    from elastic_oneshot.models import families

    for module in pkgutil.iter_modules(families.__path__):
        importlib.import_module(f"{families.__name__}.{module.name}")


class Family:
    """The generic adapter, for every model type that registers none."""

    stack = "layers"  # the decoder's attribute holding its layers (a ModuleList)
    layer_outputs = 1  # how many values the decoder takes from each layer's call (hidden states first)
    carried: tuple[str, ...] = ()  # layer arguments that ride with the hidden states (riders.py), per sample
    # Sibling Linears that read one input, and so share one Hessian (vLLM merges each set into one matrix).
    shared_inputs = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
    # Siblings that share NVFP4's global scale: the peer's FUSED_LAYER_NAMES (llmcompressor/observers/helpers.py),
    # the sets vLLM fuses; the last two are solved apart here.
    fused_scales = shared_inputs + (("q_a_proj", "kv_a_proj_with_mqa"), ("w1", "w3"))

    def __init__(self):
        self._offset: dict[type, bool] = {}  # norm class -> offset_norm's answer

    def auto_class(self, config) -> type:
        """The Auto class that builds the whole model of `config`: an image-text model (its vision tower included)
        where the config has a language model inside, a causal LM otherwise."""
        if config.get_text_config() is not config:
            return transformers.AutoModelForImageTextToText
        return transformers.AutoModelForCausalLM

    def decoder(self, skeleton: torch.nn.Module) -> torch.nn.Module:
        """The language model's decoder, through a causal LM nested in an image-text model (Llama 4's)."""
        decoder = skeleton.get_decoder()
        while not hasattr(decoder, self.stack) and isinstance(getattr(decoder, "model", None), torch.nn.Module):
            decoder = decoder.model  # a causal LM's body
        return decoder

    def layers(self, decoder: torch.nn.Module) -> torch.nn.ModuleList | None:
        """The decoder's stack of layers, run one by one; None if it has none."""
        layers = getattr(decoder, self.stack, None)
        return layers if isinstance(layers, torch.nn.ModuleList) else None

    def embedding(self, decoder: torch.nn.Module) -> str:
        """The name of the decoder's token embedding (Llama's `embed_tokens`, GPT-NeoX's `embed_in`)."""
        return next(n for n, m in decoder.named_children() if m is decoder.get_input_embeddings())

    def stand_ins(self, decoder: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """Decoder children to replace when only the layers' inputs are wanted: the final norm (its output is never
        used) and the rotary embedding, built afresh (its buffers are not in the checkpoint; Granite 4 hybrids
        have none)."""
        out = {}
        if isinstance(getattr(decoder, "norm", None), torch.nn.Module):
            out["norm"] = torch.nn.Identity()
        if getattr(decoder, "rotary_emb", None) is not None:
            out["rotary_emb"] = type(decoder.rotary_emb)(config=decoder.config)
        return out

    def stream(self, hidden: torch.Tensor, calls: list[dict]) -> torch.Tensor:
        """Layer 0's input for a batch, from its embedded `hidden` states and the decoder's call of each layer (its
        arguments by name): what the layer loop carries from layer to layer. The hidden states alone, unless the
        family's layers take per-sample values besides them (riders.py)."""
        return hidden

    def ride(self, layer: torch.nn.Module, index: int):
        """Make loaded decoder layer `index` take and give what `stream` starts: hooks that unpack what rides with
        its hidden states into the arguments it takes (`carried`) and pack what later layers need after its output
        (riders.ride). Nothing for a family whose layers take the hidden states alone."""

    def input_key(self, all_experts: bool) -> Callable[[str], Hashable]:
        """What a quantized module reads, as a key (modules with one key share one Hessian): the siblings of
        `shared_inputs` read one input; under all-experts calibration every expert's gate and up projections read
        every token, one input for all of them."""
        def key(name: str) -> Hashable:
            expert = self.expert_of(name)
            if all_experts and expert and expert[2] in ("gate_proj", "up_proj"):
                return expert[0], "gate_up"
            parent, _, leaf = name.rpartition(".")
            return next(((parent, s) for s in self.shared_inputs if leaf in s), name)
        return key

    @staticmethod
    def expert_of(name: str) -> tuple[str, int, str] | None:
        """(experts container, expert, projection) for the Linear of an expert split from a fused container
        (moe.Expert), by its name in the skeleton; None for any other module."""
        found = EXPERT.match(name)
        return (found.group(1), int(found.group(2)), found.group(3)) if found else None

    def experts_per_token(self, config) -> int | None:
        """How many experts route each token, as the config names it; None if it names none."""
        text = config.get_text_config()
        return next((getattr(text, k) for k in TOP_K if getattr(text, k, None)), None)

    def context(self, config) -> int | None:
        """The longest sequence the model was trained on (an image-text model's is its language model's)."""
        return getattr(config.get_text_config(), "max_position_embeddings", None)

    def layer_attributes(self, layer: torch.nn.Module) -> dict:
        """What the decoder's forward may read off a layer besides calling it (for the stand-in that records the
        layers' inputs)."""
        return {"attention_type": getattr(layer, "attention_type", None)}

    def experts(self, module: torch.nn.Module) -> Layout | None:
        """The layout of a fused experts container as transformers declares it (`use_experts_implementation`, whose
        defaults hold for a class it does not declare): gate and up in one 3D parameter (or up alone, where it
        declares no gate: NemotronH's), the down projection in another, and the default gating (act(gate) * up, or
        act(up)) or the class's own `_apply_gate` on the fused projection. None for any other module, or for one
        whose shapes do not fit that layout."""
        gated = getattr(module, "has_gate", True)
        up, down = getattr(module, "gate_up_proj" if gated else "up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)
                and up.dim() == 3 and down.dim() == 3):
            return None
        interleaved = not getattr(module, "is_concatenated", True)
        if gated and "." in getattr(type(module), "_apply_gate", len).__qualname__:  # a method, not the default
            gating = own_gating(module._apply_gate, interleaved)
        elif callable(getattr(module, "act_fn", None)):
            gating = default_gating(module.act_fn) if gated else module.act_fn
        else:
            return None
        layout = Layout(gating, transposed=getattr(module, "is_transposed", False), interleaved=interleaved,
                        bias=getattr(module, "has_bias", False), gated=gated)
        return layout if _fits(module, layout) else None

    def unsplit_experts(self, skeleton: torch.nn.Module) -> list[str]:
        """Experts containers left fused (a layout `experts` does not give): no Linear-based quantization reaches
        them. Known by their class's name and parameters of three or more dimensions."""
        return [name for name, m in skeleton.named_modules()
                if getattr(m, "num_experts", None) and any(p.dim() >= 3 for p in m.parameters(recurse=False))]

    def default_ignores(self, skeleton: torch.nn.Module) -> list[str]:
        """Linear modules kept in high precision whatever the recipe targets: those outside the language model's
        decoder layers (a vision tower, a multimodal projector, lm_head, Gemma 4's projection of the per-layer
        inputs), which calibration never reaches; and in MoE blocks those that decide routing rather than compute:
        beside the experts, with one output per expert (a router, such as PhiMoE's `router` or HunYuan's `gate.wg`)
        or a single one (a shared expert's gate, such as Qwen2-MoE's `shared_expert_gate`). vLLM builds those
        unquantized, and transformers cannot initialize a quantized router (PhiMoE's)."""
        inside = {id(m) for m in self.layers(self.decoder(skeleton)).modules()}
        dense = [n for n, m in skeleton.named_modules() if isinstance(m, torch.nn.Linear) and id(m) not in inside]
        containers = {n: len(m) for n, m in skeleton.named_modules() if isinstance(m, Experts)}
        for name in self.unsplit_experts(skeleton):  # JetMoE's routers, beside experts that stay fused
            containers[name] = next(p for p in skeleton.get_submodule(name).parameters() if p.dim() >= 3).shape[0]
        for name, count in containers.items():
            block, own = name.rpartition(".")[0], {id(m) for m in skeleton.get_submodule(name).modules()}
            dense += [n for n, m in skeleton.get_submodule(block).named_modules(prefix=block) if
                      isinstance(m, torch.nn.Linear) and id(m) not in own and m.out_features in (1, count)]
        return dense

    def smoothing_mappings(self, config) -> tuple:
        """SmoothQuant's default mappings for the model (models/mappings.py, by its class, as the peer's registry)."""
        return mappings.smoothing_mappings((config.architectures or [""])[0])

    def awq_mappings(self, config) -> tuple:
        """AWQ's default mappings for the model (models/mappings.py, by its class, as the peer's registry)."""
        return mappings.awq_mappings((config.architectures or [""])[0])

    def offset_norm(self, norm: torch.nn.Module) -> bool:
        """Whether a norm multiplies its output by 1 + weight (Gemma's, Qwen3-Next's), as SmoothQuant and AWQ fold
        it: found by running a copy with a zero weight (an offset norm then passes its input on, normalized)."""
        weight = getattr(norm, "weight", None)
        if isinstance(norm, torch.nn.Linear) or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            return False
        if type(norm) not in self._offset:
            probe = copy.deepcopy(norm).to("cpu", torch.float32)
            probe.weight = torch.nn.Parameter(torch.zeros(weight.shape[0]), requires_grad=False)
            try:
                with torch.no_grad():
                    self._offset[type(norm)] = bool(probe(torch.ones(1, 1, weight.shape[0])).abs().sum() > 0)
            except Exception:  # not a norm of one input: folded plainly
                self._offset[type(norm)] = False
        return self._offset[type(norm)]

    def stored_names(self, skeleton: torch.nn.Module, checkpoint_names) -> dict[str, str]:
        """Skeleton tensor name -> the checkpoint's, for the names that differ: transformers' conversion mappings."""
        return stored_names.stored_names(skeleton, checkpoint_names)

    def assembled(self, skeleton: torch.nn.Module, checkpoint_names) -> dict[str, tuple[list[str], int]]:
        """Skeleton tensor name -> (the checkpoint tensors concatenated into it, the dimension): transformers'
        conversion mappings."""
        return stored_names.assembled(skeleton, checkpoint_names)

    def fused_in_checkpoint(self, skeleton: torch.nn.Module, checkpoint_names) -> dict[str, tuple[str, str]]:
        """Checkpoint name -> (experts container, its fused parameter) for tensors stored fused where the skeleton
        holds one Linear per expert."""
        return stored_names.fused_in_checkpoint(skeleton, checkpoint_names)

    def teach_loader(self, skeleton: torch.nn.Module):
        """Before transformers loads a checkpoint written here: converters from per-expert weights to the fused
        experts, where transformers has none for the type (GPT-OSS, GraniteMoE: stored_names.teach_loader)."""
        experts = next((m for m in skeleton.modules() if isinstance(m, Experts)), None)
        if experts is not None:
            stored_names.teach_loader(skeleton, experts)


def _fits(module: torch.nn.Module, layout: Layout) -> bool:
    """A fused container's down projection (and biases) have the shapes its up projection implies in `layout`."""
    up, down = getattr(module, layout.fused[0]), module.down_proj
    if layout.transposed:
        up, down = up.transpose(1, 2), down.transpose(1, 2)
    num, intermediate, hidden = up.shape
    shapes = [((num, hidden, intermediate // (2 if layout.gated else 1)), down)]
    if layout.bias:
        shapes += [((num, intermediate), getattr(module, f"{layout.fused[0]}_bias", None)),
                   ((num, hidden), getattr(module, "down_proj_bias", None))]
    return all(isinstance(t, torch.Tensor) and tuple(t.shape) == shape for shape, t in shapes)
