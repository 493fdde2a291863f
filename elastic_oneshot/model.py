"""The source model, never materialized: a meta skeleton plus tensors read from safetensors on demand."""

import copy
import functools
import hashlib
import json
import os
import struct

import torch
import transformers
from safetensors import SafetensorError, safe_open

from .errors import UsageError
from .moe import fused_experts, make_quantizable
from .stored_names import stored_names


def _read_header(path: str) -> bytes:
    """A safetensors file's JSON header, checked against the file's size, so that a truncated or damaged
    shard is reported by name before any work rather than when its tensors are first read."""
    damaged = UsageError(f"model file {path} is truncated or damaged (not a readable safetensors file): "
                         "restore it from the original model")
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else size
            raw = f.read(n) if n <= size - 8 else b""
    except OSError as e:
        raise UsageError(f"cannot read model file {path} ({e.strerror}): check that it exists and is "
                         "readable") from None
    try:
        entries = [v for k, v in json.loads(raw).items() if k != "__metadata__"]
        end = max((v["data_offsets"][1] for v in entries), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise damaged from None
    if 8 + n + end != size:
        raise damaged
    return raw


def _tied_groups(module: torch.nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """The module's stored tensors, each with every name it goes by (tied weights have several)."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), ([], tensor))[0].append(name)
    return list(groups.values())


class SourceModel:
    """A Hugging Face model directory: config, meta skeleton, and per-layer weights read lazily."""

    def __init__(self, path: str, trust_remote_code: bool = False, attention: str = "eager"):
        """`path`: a model directory, or (for planning only) a config.json on its own. `attention`: eager
        by default, because llmcompressor's traced calibration computes attention exactly as eager does
        (sdpa differs in the last bits, and GPTQ's rounding decisions amplify last bits)."""
        if os.path.isfile(path) and path.endswith(".json"):
            path = os.path.dirname(path) or "."
        if not os.path.isdir(path):
            raise UsageError(f"model directory {path} does not exist")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise UsageError(f"{path} has no config.json: not a Hugging Face model directory")
        self.path = path
        try:
            self.config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (ValueError, KeyError) as e:
            raise UsageError(f"cannot read {path}/config.json: {str(e).splitlines()[0]}") from e
        self.dtype = self.config.dtype or torch.float32
        if isinstance(self.dtype, str):
            self.dtype = getattr(torch, self.dtype)
        self.skeleton = self._skeleton(trust_remote_code, attention)
        self.decoder = self.skeleton.get_decoder()
        self.layers = getattr(self.decoder, "layers", None)
        if not isinstance(self.layers, torch.nn.ModuleList):
            self._refuse(f"its decoder {type(self.decoder).__name__} has no stack of layers (.layers)")
        fused = fused_experts(self.skeleton)
        if fused:
            self._refuse(f"its experts {fused[0]} ({type(self.skeleton.get_submodule(fused[0])).__name__}) are "
                         "fused in a layout that cannot be split into Linear modules")
        self.layer_prefix = next(n for n, m in self.skeleton.named_modules() if m is self.layers) + "."

    def _skeleton(self, trust_remote_code: bool, attention: str) -> torch.nn.Module:
        """The causal LM on the meta device, its fused experts split into Linear modules."""
        try:
            with torch.device("meta"):
                skeleton = transformers.AutoModelForCausalLM.from_config(
                    self.config, dtype=self.dtype, attn_implementation=attention,
                    trust_remote_code=trust_remote_code)
        except (ValueError, KeyError, ImportError) as e:
            self._refuse(str(e).splitlines()[0] if str(e) else type(e).__name__)
        make_quantizable(skeleton)
        return skeleton

    def _refuse(self, reason: str):
        """Support is what the layer-by-layer loop needs; a model that lacks it is refused before any work."""
        arch = ",".join(getattr(self.config, "architectures", None) or [self.config.model_type])
        raise UsageError(f"architecture {arch} (model_type {self.config.model_type!r}) is not supported: {reason}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @functools.cached_property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> shard file (read on first use, so a config alone can be planned)."""
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                return {k: os.path.join(self.path, v) for k, v in json.load(f)["weight_map"].items()}
        files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not files:
            raise UsageError(f"{self.path} has no .safetensors weights")
        return {name: os.path.join(self.path, f) for f in files
                for name in json.loads(_read_header(os.path.join(self.path, f))) if name != "__metadata__"}

    def check_weights(self):
        """Before any work: every tensor that a layer or the export reads is in a readable shard, with the shape
        the config implies (tied weights need one of their names)."""
        shapes, where = {}, {}
        for shard in sorted(set(self.weight_map.values())):
            for name, entry in json.loads(_read_header(shard)).items():
                if name != "__metadata__":
                    shapes[name], where[name] = tuple(entry["shape"]), shard
        for names, tensor in _tied_groups(self.skeleton):
            present = [n for n in names if self.stored_name(n) in shapes]
            if not present:
                raise UsageError(f"model {self.path} lacks tensor {names[0]}: the checkpoint is incomplete or "
                                 "of another layout")
            for name in map(self.stored_name, present):
                if shapes[name] != tuple(tensor.shape):
                    raise UsageError(f"tensor {name} in {where[name]} has shape {list(shapes[name])}, but the "
                                     f"config implies {list(tensor.shape)}: the weights do not match config.json")

    @functools.cached_property
    def stored(self) -> dict[str, str]:
        """Skeleton tensor name -> the checkpoint's, where transformers' loader converts one into the other."""
        return stored_names(self.skeleton, self.weight_map)

    def stored_name(self, name: str) -> str:
        """The checkpoint's name for a skeleton tensor, or for one that the export writes in place of a weight
        (a quantized weight's `weight_packed` goes where its `weight` was stored)."""
        if name in self.stored:
            return self.stored[name]
        module, _, leaf = name.rpartition(".")
        weight = self.stored.get(f"{module}.weight")
        return f"{weight.rpartition('.')[0]}.{leaf}" if weight else name

    def digest(self) -> str:
        """Identity of the model: its config and the headers (names, dtypes, shapes, offsets) of its shards."""
        h = hashlib.sha256()
        with open(os.path.join(self.path, "config.json"), "rb") as f:
            h.update(f.read())
        for shard in sorted(set(self.weight_map.values())):
            h.update(os.path.basename(shard).encode())
            h.update(str(os.path.getsize(shard)).encode())
            h.update(_read_header(shard))
        return h.hexdigest()

    def read(self, names) -> dict[str, torch.Tensor]:
        """Tensors by their skeleton names."""
        stored = {n: self.stored_name(n) for n in names}
        tensors = self.read_stored(list(stored.values()))
        return {n: tensors[s] for n, s in stored.items()}

    def read_stored(self, names) -> dict[str, torch.Tensor]:
        """Tensors by the checkpoint's names."""
        missing = [n for n in names if n not in self.weight_map]
        if missing:
            raise UsageError(f"{self.path} lacks tensors {missing[:3]}: unsupported checkpoint layout")
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.weight_map[n], []).append(n)
        out = {}
        for path, group in by_file.items():
            try:
                with safe_open(path, "pt") as f:
                    out.update({n: f.get_tensor(n) for n in group})
            except SafetensorError as e:  # changed since the start, where every header was checked
                raise UsageError(f"model file {path} is truncated or damaged ({e}): restore it from the "
                                 "original model, then run again to resume") from None
        return out

    def load(self, module: torch.nn.Module, prefix: str) -> torch.nn.Module:
        """A CPU copy of a meta submodule with its weights read from the checkpoint."""
        module = copy.deepcopy(module)
        state = module.state_dict()
        tensors = self.read([prefix + k for k in state])
        module.load_state_dict({k: tensors[prefix + k].to(v.dtype) for k, v in state.items()},
                               assign=True, strict=True)
        for sub in module.modules():
            self._build_buffers(sub)
        if any(b.is_meta for b in module.buffers()):
            raise UsageError(f"{type(module).__name__} has buffers not stored in the checkpoint: "
                             "unsupported architecture")
        return module.requires_grad_(False).eval()

    def _build_buffers(self, module: torch.nn.Module):
        """Buffers the checkpoint does not carry (Gemma's embed_scale), built as transformers builds them: by the
        model's own weight initialization, run on a copy whose parameters stay on the meta device (untouched)."""
        meta = [name for name, b in module.named_buffers(recurse=False) if b.is_meta]
        if not meta:
            return
        probe = copy.copy(module)
        probe._buffers = {n: torch.empty_like(b, device="cpu") if n in meta else b for n, b in module._buffers.items()}
        probe._parameters = {n: torch.nn.Parameter(p.detach().to("meta"), p.requires_grad) if p is not None else None
                             for n, p in module._parameters.items()}
        with torch.no_grad():
            self.skeleton._init_weights(probe)
        for name in meta:
            module._buffers[name] = probe._buffers[name]

    def load_layer(self, index: int) -> torch.nn.Module:
        return self.load(self.layers[index], f"{self.layer_prefix}{index}.")

    def by_layer(self, names: list[str]) -> list[list[str]]:
        """Module names (full) per decoder layer, as names local to their layer. GPTQ runs layer by layer,
        so a module outside the decoder layers is refused."""
        out: list[list[str]] = [[] for _ in range(self.num_layers)]
        for name in names:
            if not name.startswith(self.layer_prefix):
                raise UsageError(f"{name} is outside the decoder layers and cannot be quantized here: "
                                 "add it to --ignore")
            index, _, local = name[len(self.layer_prefix):].partition(".")
            out[int(index)].append(local)
        return out

    def linear_shapes(self, names) -> dict[str, tuple[int, int]]:
        modules = dict(self.skeleton.named_modules())
        return {n: tuple(modules[n].weight.shape) for n in names}


class _Catcher(torch.nn.Module):
    """Stands in for a decoder layer: records the arguments it is called with, passes hidden states on."""

    def __init__(self, layer, record: list):
        super().__init__()
        self.attention_type = getattr(layer, "attention_type", None)
        self.record = record

    def forward(self, hidden_states, *args, **kwargs):
        self.record.append((hidden_states, args, kwargs))
        return hidden_states


class Embedder:
    """Layer 0's inputs from token ids, and the keyword arguments (position embeddings, masks) that
    every decoder layer takes, produced by the model's own forward with the layers stubbed out."""

    def __init__(self, source: SourceModel):
        decoder = source.decoder
        prefix = next(n for n, m in source.skeleton.named_modules() if m is decoder)
        shell = copy.deepcopy(decoder)
        self.record: list = []
        shell.layers = torch.nn.ModuleList(_Catcher(layer, self.record) for layer in decoder.layers)
        shell.norm = torch.nn.Identity()
        shell.rotary_emb = type(decoder.rotary_emb)(config=source.config)
        self._load = lambda: source.load(decoder.embed_tokens, f"{prefix}.embed_tokens.")
        shell.embed_tokens = self._load()
        if any(t.is_meta for t in list(shell.parameters()) + list(shell.buffers())):
            raise UsageError(f"{type(decoder).__name__} has modules besides embeddings, rotary "
                             "embeddings, layers and norm: unsupported architecture")
        self.shell = shell.eval()
        self._kwargs: dict[int, list[dict]] = {}

    def release(self):
        """Drop the embedding table (vocab x hidden) once layer 0 is done; it is read again if needed."""
        self.shell.embed_tokens = None

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedded hidden states for a batch of samples; caches the per-layer kwargs for its size."""
        if self.shell.embed_tokens is None:
            self.shell.embed_tokens = self._load()
        self.record.clear()
        self.shell(input_ids=input_ids, use_cache=False)
        hidden = self.record[0][0]
        if input_ids.shape[0] not in self._kwargs:
            self._kwargs[input_ids.shape[0]] = [self._layer_kwargs(args, kw) for _, args, kw in self.record]
        self.record.clear()
        return hidden

    @staticmethod
    def _layer_kwargs(args, kwargs):
        if args:
            raise UsageError("decoder layers take positional arguments besides hidden states: "
                             "unsupported architecture")
        return {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value")}

    def layer_kwargs(self, layer: int, batch: int, seq_len: int) -> dict:
        if batch not in self._kwargs:
            self(torch.zeros(batch, seq_len, dtype=torch.int64))
        return self._kwargs[batch][layer]
