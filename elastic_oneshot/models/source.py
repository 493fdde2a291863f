"""The source model, never materialized: a meta skeleton plus tensors read from safetensors on demand."""

import contextlib
import copy
import functools
import hashlib
import inspect
import json
import logging
import os
import struct

import torch
import transformers
from safetensors import SafetensorError, safe_open

from elastic_oneshot.errors import UsageError
from elastic_oneshot.models.family import family_for
from elastic_oneshot.models.moe import Experts, make_quantizable, streamed

log = logging.getLogger("elastic_oneshot")


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


def teach_transformers(path: str):
    """Before transformers loads, in a new process, a checkpoint written here whose experts it only knows fused
    (GPT-OSS, GraniteMoE: Family.teach_loader); for other types nothing is needed."""
    SourceModel(path)


def _build_buffers(skeleton: torch.nn.Module):
    """Buffers the checkpoint does not carry (Gemma's embed_scale, MiniCPM3's integer one, Falcon-H1's mup_vector),
    built as transformers builds them: by the model's own weight initialization, which may set a module's buffers
    from an ancestor (Falcon-H1's model sets its mixers'); the parameters stay on the meta device. It runs twice, on
    buffers of zeros and of ones: one whose value depends on which (left unset) goes back to meta, so that loading
    its layer is refused rather than run on garbage."""
    stored = set(skeleton.state_dict())
    built = [(module, leaf) for name, module in skeleton.named_modules()
             for leaf, b in module.named_buffers(recurse=False)
             if b.is_meta and f"{name}.{leaf}".lstrip(".") not in stored]
    if not built:
        return
    fresh = [m for m in skeleton.modules() if not getattr(m, "_is_hf_initialized", False)]
    runs = []
    for fill in (0, 1):
        for module, leaf in built:
            module._buffers[leaf] = torch.full_like(module._buffers[leaf], fill, device="cpu")
        for module in fresh:  # initialization marks what it has done, and skips it after
            module.__dict__.pop("_is_hf_initialized", None)
        skeleton.initialize_weights()
        runs.append([module._buffers[leaf] for module, leaf in built])
    for (module, leaf), first, second in zip(built, *runs):
        if not torch.equal(first, second):
            module._buffers[leaf] = second.to("meta")


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
        if os.path.isfile(path):
            raise UsageError(f"model {path} is a file, not a model directory: give the directory holding "
                             "config.json and the safetensors")
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
        self.family = family_for(self.config)
        self.skeleton = self._skeleton(trust_remote_code, attention)
        self.decoder = self.family.decoder(self.skeleton)
        self.layers = self.family.layers(self.decoder)
        if self.layers is None:
            self.refuse(f"its decoder {type(self.decoder).__name__} has no stack of layers (.{self.family.stack})")
        fused = self.family.unsplit_experts(self.skeleton)
        if fused:  # JetMoE's: neither vLLM nor llm-compressor reads them per expert
            log.warning("the experts of %s (%s, in %d modules: %s) stay dense: they are fused in a layout that is not "
                        "split into Linear modules", self.config.model_type,
                        type(self.skeleton.get_submodule(fused[0])).__name__, len(fused), ", ".join(fused[:2]))
        self.layer_prefix = next(n for n, m in self.skeleton.named_modules() if m is self.layers) + "."

    def _skeleton(self, trust_remote_code: bool, attention: str) -> torch.nn.Module:
        """The causal LM on the meta device, its fused experts split into Linear modules."""
        try:
            with torch.device("meta"):
                skeleton = self.family.auto_class(self.config).from_config(
                    self.config, dtype=self.dtype, attn_implementation=attention,
                    trust_remote_code=trust_remote_code)
        except (ValueError, KeyError, ImportError) as e:
            self.refuse(str(e).splitlines()[0] if str(e) else type(e).__name__)
        with torch.device("meta"):  # the experts' own modules too: a skeleton never holds a weight
            make_quantizable(skeleton, self.family.experts)
        _build_buffers(skeleton)
        self.family.teach_loader(skeleton)
        return skeleton

    def refuse(self, reason: str):
        """Support is what the layer-by-layer loop needs; a model that lacks it is refused before any work."""
        arch = ",".join(self.config.architectures or [self.config.model_type])
        raise UsageError(f"architecture {arch} (model_type {self.config.model_type!r}) is not supported: {reason}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @functools.cached_property
    def files(self) -> dict[str, str]:
        """The checkpoint's tensor name -> shard file (read on first use, so a config alone can be planned)."""
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                return {k: os.path.join(self.path, v) for k, v in json.load(f)["weight_map"].items()}
        files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not files:
            raise UsageError(f"{self.path} has no .safetensors weights")
        return {name: os.path.join(self.path, f) for f in files
                for name in json.loads(_read_header(os.path.join(self.path, f))) if name != "__metadata__"}

    @functools.cached_property
    def fused(self) -> dict[str, tuple[str, str, str]]:
        """Per-expert tensor name -> (the checkpoint's fused tensor holding it, its experts container, the
        container's parameter), for experts the checkpoint stores fused."""
        out = {}
        for stored, (container, param) in self.family.fused_in_checkpoint(self.skeleton, self.files).items():
            for local in self.skeleton.get_submodule(container).unfused_names(param):
                out[f"{container}.{local}"] = (stored, container, param)
        return out

    @functools.cached_property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> shard file: the checkpoint's, with experts stored fused listed one tensor per expert
        (as the skeleton and the export hold them)."""
        whole = {stored for stored, _, _ in self.fused.values()}
        view = {n: f for n, f in self.files.items() if n not in whole}
        view.update({n: self.files[stored] for n, (stored, _, _) in self.fused.items()})
        return view

    @functools.cached_property
    def assembled(self) -> dict[str, tuple[list[str], int]]:
        """Skeleton tensor name -> (the checkpoint's tensors concatenated into it, the dimension)."""
        return self.family.assembled(self.skeleton, self.files)

    def check_weights(self):
        """Before any work: every tensor that a layer or the export reads is in a readable shard, with the shape
        the config implies (tied weights need one of their names)."""
        shapes, where = {}, {}
        for shard in sorted(set(self.files.values())):
            for name, entry in json.loads(_read_header(shard)).items():
                if name != "__metadata__":
                    shapes[name], where[name] = tuple(entry["shape"]), shard
        for stored, container, param in set(self.fused.values()):
            split = self.skeleton.get_submodule(container).unfused(param, torch.empty(shapes[stored], device="meta"))
            shapes.update({f"{container}.{k}": tuple(v.shape) for k, v in split.items()})
            where.update({f"{container}.{k}": where[stored] for k in split})
        for name, (parts, dim) in self.assembled.items():
            shapes[name] = tuple(torch.cat([torch.empty(shapes[p], device="meta") for p in parts], dim).shape)
            where[name] = where[parts[0]]
        for names, tensor in _tied_groups(self.skeleton):
            present = [n for n in names if self.stored_name(n) in shapes]
            if not present:
                raise UsageError(f"model {self.path} lacks tensor {names[0]}: the checkpoint is incomplete or "
                                 "of another layout")
            for name in map(self.stored_name, present):
                if shapes[name] != tuple(tensor.shape):
                    raise UsageError(f"tensor {name} in {where[name]} has shape {list(shapes[name])}, but the "
                                     f"config implies {list(tensor.shape)}: the weights do not match config.json")
        self._check_layer_count(shapes)

    def _check_layer_count(self, names):
        """Layers in the shards past the config's (beyond its multi-token-prediction layers, which checkpoints
        store after the decoder's): the config would hide them, and the export could not account for them."""
        first = next(n for n, _ in self.skeleton.named_parameters() if n.startswith(f"{self.layer_prefix}0."))
        stored = self.stored_name(first)
        if ".0." not in stored:
            return
        head = stored[:stored.index(".0.") + 1]  # the stack's prefix in the checkpoint: model.layers.
        known = self.num_layers + self.config.to_dict().get("num_nextn_predict_layers", 0)
        extra = sorted({int(i) for n in names if n.startswith(head)
                        and (i := n[len(head):].split(".", 1)[0]).isdigit() and int(i) >= known})
        if extra:
            raise UsageError(f"model {self.path}: its weights hold layers up to {extra[-1]}, but config.json says "
                             f"num_hidden_layers {self.num_layers}: the weights do not match config.json")

    @functools.cached_property
    def stored(self) -> dict[str, str]:
        """Skeleton tensor name -> the checkpoint's, where transformers' loader converts one into the other."""
        return self.family.stored_names(self.skeleton, self.files)

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
        for shard in sorted(set(self.files.values())):
            h.update(os.path.basename(shard).encode())
            h.update(str(os.path.getsize(shard)).encode())
            h.update(_read_header(shard))
        return h.hexdigest()

    def stored_sources(self, name: str) -> list[str]:
        """The checkpoint's tensors that skeleton tensor `name` is read from (a fused experts tensor as stored)."""
        parts = self.assembled[name][0] if name in self.assembled else [self.stored_name(name)]
        return [self.fused[p][0] if p in self.fused else p for p in parts]

    def read(self, names) -> dict[str, torch.Tensor]:
        """Tensors by their skeleton names (concatenated from their parts where the checkpoint stores them so)."""
        stored = {n: self.assembled[n][0] if n in self.assembled else [self.stored_name(n)] for n in names}
        tensors = self.read_stored(list(dict.fromkeys(p for parts in stored.values() for p in parts)))
        return {n: tensors[parts[0]] if len(parts) == 1 else torch.cat([tensors[p] for p in parts],
                                                                       self.assembled[n][1])
                for n, parts in stored.items()}

    def read_stored(self, names) -> dict[str, torch.Tensor]:
        """Tensors by the checkpoint's names (per expert for experts stored fused: see `weight_map`)."""
        missing = [n for n in names if n not in self.weight_map]
        if missing:
            raise UsageError(f"{self.path} lacks tensors {missing[:3]}: unsupported checkpoint layout")
        whole = {self.fused[n][0]: self.fused[n][1:] for n in names if n in self.fused}
        by_file: dict[str, list[str]] = {}
        for n in [n for n in names if n not in self.fused] + sorted(whole):
            by_file.setdefault(self.files[n], []).append(n)
        out = {}
        for path, group in by_file.items():
            try:
                with safe_open(path, "pt") as f:
                    out.update({n: f.get_tensor(n) for n in group})
            except SafetensorError as e:  # changed since the start, where every header was checked
                raise UsageError(f"model file {path} is truncated or damaged ({e}): restore it from the "
                                 "original model, then run again to resume") from None
        for stored, (container, param) in whole.items():
            split = self.skeleton.get_submodule(container).unfused(param, out.pop(stored))
            out.update({f"{container}.{k}": v for k, v in split.items()})
        return {n: out[n] for n in names}

    def load(self, module: torch.nn.Module, prefix: str, skip: tuple[str, ...] = ()) -> torch.nn.Module:
        """A CPU copy of a meta submodule with its weights read from the checkpoint, but for those whose names
        start with one of `skip` (left on the meta device)."""
        module = copy.deepcopy(module)
        state = {k: v for k, v in module.state_dict().items() if not k.startswith(skip)}
        tensors = self.read([prefix + k for k in state])
        module.load_state_dict({k: tensors[prefix + k].to(v.dtype) for k, v in state.items()},
                               assign=True, strict=not skip)
        if any(b.is_meta for b in module.buffers()):
            raise UsageError(f"{type(module).__name__} has buffers not stored in the checkpoint: "
                             "unsupported architecture")
        return module.requires_grad_(False).eval()

    def streamable(self, index: int) -> list[str]:
        """Layer `index`'s experts containers whose experts can be streamed: stored one by one (reading one
        expert of a fused tensor reads them all) and called with the routed tokens."""
        prefix = f"{self.layer_prefix}{index}."
        fused = [n for n in self.fused if n.startswith(prefix)]
        return [n for n, m in self.layers[index].named_modules() if isinstance(m, Experts) and not m.layout.stacked
                and not any(f.startswith(f"{prefix}{n}.") for f in fused)]

    def layer_bytes(self, streamed: bool = False) -> list[int]:
        """Each decoder layer's weights in memory (as `load_layer` reads them), from the skeleton's shapes; or
        (`streamed`) those it holds at least: all but its streamable experts, and the largest of those."""
        return [self._held_bytes(index, streamed) for index in range(self.num_layers)]

    def _held_bytes(self, index: int, streamed: bool) -> int:
        layer = self.layers[index]
        experts = self.streamable(index) if streamed else []
        held = sum(t.nbytes for k, t in layer.state_dict().items() if not k.startswith(tuple(f"{n}." for n in experts)))
        return held + max((sum(t.nbytes for t in e.state_dict().values()) for n in experts
                           for e in layer.get_submodule(n)), default=0)

    def load_layer(self, index: int, device="cpu", budget: int | None = None) -> torch.nn.Module:
        """Decoder layer `index` on `device`, taking and giving what rides with its hidden states (Family.ride).
        Where its weights would take more than half of `budget` (bytes), its streamable experts are streamed
        (moe.Experts.streamed): read a batch at a time by `hold`, or one at a time when called (`fetch`: the
        original weights, until the caller sets another)."""
        prefix, layer = f"{self.layer_prefix}{index}.", self.layers[index]
        experts = self.streamable(index) if budget is not None and self._held_bytes(index, False) > budget // 2 else []
        module = self.load(layer, prefix, tuple(f"{n}." for n in experts))
        module._apply(lambda t: t if t.is_meta else t.to(device))  # Module.to refuses meta tensors
        for name in experts:
            container = module.get_submodule(name)
            container.streamed = True
            container.fetch = functools.partial(self.expert, index, name, device=device)
        self.family.ride(module, index)
        return module

    def expert(self, index: int, container: str, e: int, device="cpu", without: tuple[str, ...] = ()) -> dict:
        """The original weights of expert `e` of `container` in layer `index`, local to it, on `device`; but
        `without` those."""
        prefix = f"{self.layer_prefix}{index}.{container}.{e}."
        state = {k: t for k, t in self.layers[index].get_submodule(f"{container}.{e}").state_dict().items()
                 if k not in without}
        tensors = self.read([prefix + k for k in state])
        return {k: tensors[prefix + k].to(device, t.dtype) for k, t in state.items()}

    @contextlib.contextmanager
    def hold(self, module: torch.nn.Module, index: int, names: list[str], device="cpu"):
        """Inside, the streamed experts that modules `names` of layer `index` (`module`) belong to are held,
        with their original weights on `device`; outside, they are on the meta device again."""
        held = sorted({(c, int(n[len(c) + 1:].split(".")[0])) for c in streamed(module) for n in names
                       if n.startswith(f"{c}.")})
        try:
            for c, e in held:
                module.get_submodule(f"{c}.{e}").load_state_dict(self.expert(index, c, e, device), assign=True)
            yield
        finally:
            for c, e in held:
                module.get_submodule(f"{c}.{e}").to("meta")

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


def _meta(module: torch.nn.Module):
    return (t.is_meta for t in list(module.parameters()) + list(module.buffers()))


class _Catcher(torch.nn.Module):
    """Stands in for a decoder layer (with the attributes the decoder reads off it): records the arguments it is
    called with, passes hidden states on."""

    def __init__(self, attributes: dict, record: list, outputs: int):
        super().__init__()
        for name, value in attributes.items():
            setattr(self, name, value)
        self.record, self.outputs = record, outputs

    def forward(self, hidden_states, *args, **kwargs):
        self.record.append((hidden_states, args, kwargs))
        return hidden_states if self.outputs == 1 else (hidden_states,) + (None,) * (self.outputs - 1)


class Embedder:
    """Layer 0's inputs from token ids, and the keyword arguments (position embeddings, masks) that
    every decoder layer takes, produced by the model's own forward with the layers stubbed out. Arguments that
    depend on the tokens are the family's to carry with the hidden states (Family.stream); any other is refused."""

    def __init__(self, source: SourceModel):
        decoder, family = source.decoder, source.family
        self.source, self.family = source, family
        prefix = next(n for n, m in source.skeleton.named_modules() if m is decoder)
        shell = copy.deepcopy(decoder)
        self.record: list = []
        setattr(shell, family.stack, torch.nn.ModuleList(_Catcher(family.layer_attributes(layer), self.record,
                                                                  family.layer_outputs)
                                                         for layer in source.layers))
        for name, module in family.stand_ins(decoder).items():
            setattr(shell, name, module)
        self._embedding = family.embedding(decoder)
        self._load = lambda: source.load(decoder.get_submodule(self._embedding), f"{prefix}.{self._embedding}.")
        setattr(shell, self._embedding, self._load())
        self._embedded = True
        for name, child in decoder.named_children():  # other modules (Phi's final_layernorm), as stored
            if name not in (family.stack, self._embedding) and any(_meta(child)):
                setattr(shell, name, source.load(child, f"{prefix}.{name}."))
        if any(_meta(shell)):
            raise UsageError(f"{type(decoder).__name__} has parameters outside its modules: unsupported "
                             "architecture")
        self.shell = shell.eval()
        self._params = [_parameters(layer) for layer in source.layers]
        self._kwargs: dict[int, list[dict]] = {}

    def release(self):
        """Drop the embedding table (vocab x hidden) once layer 0 is done; it is read again if needed."""
        setattr(self.shell, self._embedding, None)
        self._embedded = False

    @torch.no_grad()
    def _calls(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
        """The embedded hidden states of a batch, and the arguments of each layer's call by name."""
        if not self._embedded:
            setattr(self.shell, self._embedding, self._load())
            self._embedded = True
        self.record.clear()
        self.shell(input_ids=input_ids, use_cache=False)
        calls = [self._named(index, args, kw) for index, (_, args, kw) in enumerate(self.record)]
        hidden = self.record[0][0]
        self.record.clear()
        return hidden, calls

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Layer 0's input for a batch of samples: the embedded hidden states, with what rides with them."""
        return self.family.stream(*self._calls(input_ids))

    def _named(self, index: int, args: tuple, kwargs: dict) -> dict:
        """A layer's call as arguments by name (GPTBigCode passes its encoder states by position)."""
        params = self._params[index]
        if len(args) > len(params):
            raise UsageError("decoder layers take positional arguments besides hidden states: "
                             "unsupported architecture")
        return {**dict(zip(params, args)), **kwargs}

    def layer_kwargs(self, layer: int, batch: int, seq_len: int) -> dict:
        """What layer `layer` takes besides its hidden states (and what rides with them), for `batch` samples of
        `seq_len` tokens. The decoder is run on two batches of other tokens: an argument whose value differs is
        per sample, and must ride with the hidden states."""
        if batch not in self._kwargs:
            _, zeros = self._calls(torch.zeros(batch, seq_len, dtype=torch.int64))
            _, ones = self._calls(torch.ones(batch, seq_len, dtype=torch.int64))
            varying = sorted({k for a, b in zip(zeros, ones) for k in a if k not in self.family.carried
                              and not _same(a[k], b.get(k))})
            if varying:
                self.source.refuse(f"its decoder layers take {', '.join(varying)}, which depend on the tokens, "
                                   "besides the hidden states")
            drop = {"past_key_values", "past_key_value", *self.family.carried}
            self._kwargs[batch] = [{k: v for k, v in call.items() if k not in drop} for call in zeros]
        return self._kwargs[batch][layer]


def _parameters(layer: torch.nn.Module) -> list[str]:
    """The names of a layer's positional parameters after the hidden states."""
    params = list(inspect.signature(layer.forward).parameters.values())[1:]
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _same(a, b) -> bool:
    """Whether two arguments of a layer's call hold the same tensors (other values are not compared)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return True
