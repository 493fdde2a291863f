"""Running jobs the way users do (a fresh interpreter, or torchrun) and comparing what they wrote: shared by the
tests and the chaos harness."""

import atexit
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import psutil
import torch
import transformers
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from safetensors import safe_open
from safetensors.torch import load_file

from elastic_oneshot.testing import zygote

JOB = ["--num-samples", 32, "--seq-len", 128, "--group-size", 64, "--chunk-size", 4]  # a quick job on tiny Llama
# The architecture sweep's job (tests/test_architectures.py): enough calibration tokens that GPTQ's Hessians describe
# held-out text (at 8 x 32, a quarter of the types did no better than round-to-nearest on it)
SWEEP = dict(num_calibration_samples=32, max_seq_length=64, group_size=32, chunk_size=8)


CLI = ("-m", "elastic_oneshot")  # what the interpreter runs: the command line (or a script that patches it first)


_ZYGOTES: dict[tuple, zygote.Zygote] = {}  # by environment, the most recently used last
_MAX_ZYGOTES = 3


def _zygote(env: dict) -> zygote.Zygote:
    found = _ZYGOTES.pop(zygote.key(env), None) or zygote.Zygote(env)
    _ZYGOTES[zygote.key(env)] = found
    idle = [k for k, z in _ZYGOTES.items() if not z.lock.locked()]
    for k in idle[:max(0, len(_ZYGOTES) - _MAX_ZYGOTES)]:  # the least recently used first
        _ZYGOTES.pop(k).close()
    return found


@atexit.register
def _close_zygotes():
    while _ZYGOTES:
        _ZYGOTES.popitem()[1].close()


def start_cli(*args, program=CLI, env=None, stdout=None, stderr=None, **popen) -> subprocess.Popen | zygote.Child:
    """`elastic-oneshot ARGS` started in a process of its own, its output to the files (or DEVNULL) given: forked from
    a zygote that has imported what it imports (zygote.py), or a fresh interpreter where it runs a program of the
    test's, needs more of subprocess.Popen (`popen`: preexec_fn, say), or another run of the same zygote has not
    ended."""
    argv, env = [*map(str, args)], dict(os.environ if env is None else env)
    server = _zygote(env) if program == CLI and not popen else None
    if server is None or not server.lock.acquire(blocking=False):
        return subprocess.Popen([sys.executable, *program, *argv], env=env, stdout=stdout, stderr=stderr, **popen)
    with contextlib.ExitStack() as files:
        def fd(given, default: int) -> int:
            if given is None:
                return default
            if given == subprocess.DEVNULL:
                return files.enter_context(open(os.devnull, "r+b")).fileno()
            return given.fileno()
        try:
            return server.start(argv, env, os.getcwd(), [fd(None, 0), fd(stdout, 1), fd(stderr, 2)])
        except BaseException:
            server.lock.release()
            raise


def run_cli(*args, check=True, program=CLI, env=None, timeout=None, **popen) -> subprocess.CompletedProcess:
    """`elastic-oneshot ARGS` run to its end (start_cli), its output captured."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = start_cli(*args, program=program, env=env, stdout=out, stderr=err, **popen)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0), err.seek(0)
        proc = subprocess.CompletedProcess(proc.args, code, out.read(), err.read())
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def torchrun_cmd(nproc: int, *args, max_restarts: int = 0, extra=(), program=CLI) -> list[str]:
    """A single-node torchrun of `elastic-oneshot ARGS` (python -m torch.distributed.run is torchrun)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.2", *extra, *program, *map(str, args)]


def one_thread_env() -> dict:
    """Results are bitwise reproducible at a fixed thread count per rank (BLAS reductions depend on it).
    Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE, torch 2.13's restarted workers can read the previous
    round's gloo addresses from the agent's reused store and fail to connect."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def run_world(world: int, model, out, job=JOB, program=CLI, **kw):
    """The job at `world` ranks of one thread each (one process without torchrun at 1)."""
    args = ["run", "--model", model, "--output", out, *job]
    if world == 1:
        return run_cli(*args, env=one_thread_env(), program=program)
    proc = subprocess.run(torchrun_cmd(world, *args, program=program, **kw), capture_output=True, text=True,
                          env=one_thread_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def workers(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    """torchrun's workers under `launcher`, by rank (none once it has ended; a worker that ends while it is looked
    at is left out)."""
    found = {}
    try:
        children = psutil.Process(launcher.pid).children(recursive=True)
    except psutil.Error:
        return found
    for child in children:
        try:
            rank = child.environ().get("RANK")
            if rank is not None and "elastic_oneshot" in " ".join(child.cmdline()):
                found[int(rank)] = child
        except psutil.Error:
            continue
    return found


def tree_digest(root) -> dict[str, str]:
    """sha256 of every file under root, by relative path."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def checkpoint_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in `path`, from all its shards."""
    out = {}
    for fname in sorted(os.listdir(path)):
        if fname.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, fname)))
    return out


def int_codes(path):
    """The W4 checkpoint's int codes by packed tensor name, and all its tensors."""
    tensors = checkpoint_tensors(path)
    return {k: unpack_from_int32(v, 4, tensors[k.replace("_packed", "_shape")])
            for k, v in tensors.items() if k.endswith("weight_packed")}, tensors


def same_codes(a, b) -> float:
    """The fraction of int codes two W4 checkpoints share."""
    ca, _ = int_codes(a)
    cb, _ = int_codes(b)
    assert ca.keys() == cb.keys()
    return sum((ca[k] == cb[k]).sum().item() for k in ca) / sum(v.numel() for v in ca.values())


def assert_same_bits(out, reference):
    """`out` is the checkpoint `reference`, byte for byte, as it is at any world size and thread count; if not, the
    AssertionError names the files that differ and, for W4 checkpoints, how many int codes they share."""
    a, b = tree_digest(out), tree_digest(reference)
    if a != b:
        differ = ", ".join(sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k)))
        packed = any(k.endswith(".safetensors") for k in a.keys() & b.keys()) and int_codes(out)[0]
        shared = f"; {same_codes(out, reference):.4%} of int codes identical" if packed else ""
        raise AssertionError(f"{out} is not {reference}, byte for byte: {differ} differ{shared}")


def packed_modules(checkpoint: str) -> set[str]:
    """The modules a compressed checkpoint holds packed (weight_packed), by its names."""
    return {k.removesuffix(".weight_packed") for k in checkpoint_tensors(checkpoint) if k.endswith(".weight_packed")}


def assert_solved(out: str, quantized: set[str]):
    """GPTQ everywhere in the run that wrote `out` (its state beside it): as many modules solved in its commits as
    `quantized`, and none fell back to round-to-nearest (`damping: null`), as a layer calibrated on garbage (an
    unbuilt buffer) would."""
    from elastic_oneshot.durability.records import FileRecords
    from elastic_oneshot.durability.state import StateStore, default_root

    records = FileRecords(StateStore(default_root(out)))
    damping = {f"{layer}.{name}": module["damping"] for layer, epoch in sorted(records.committed().items())
               for name, module in records.manifest(layer, epoch)["modules"].items()}
    assert len(damping) == len(quantized), (len(damping), len(quantized))
    assert not [m for m, d in damping.items() if d is None], damping


# Run by `check_compressed` in an interpreter that never imported elastic_oneshot, as a user loads a checkpoint (but
# where the checkpoint's README says to call teach_transformers first: the plain load is recorded before that). One
# JSON request a line on stdin, one answer a line on stdout after ANSWER.
LOAD = """
import json, runpy, sys, traceback
import torch, transformers

def load(auto, path):
    model, info = auto.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    return model.eval(), {k: sorted(info[k]) for k in ("missing_keys", "unexpected_keys")}

def check(spec):
    if spec["prelude"]:
        runpy.run_path(spec["prelude"])
    auto, ids, found = getattr(transformers, spec["auto_class"]), torch.tensor(spec["ids"]), {}
    if spec["teach"]:
        found["untaught"] = load(auto, spec["gptq"])[1]
        import elastic_oneshot
        elastic_oneshot.teach_transformers(spec["gptq"])
    found["elastic_oneshot imported"] = "elastic_oneshot" in sys.modules
    with torch.no_grad():
        reference = load(auto, spec["model"])[0](input_ids=ids).logits
        for how in ("rtn", "gptq"):
            model, found[how] = load(auto, spec[how])
            found[how]["error"] = (torch.linalg.norm(model(input_ids=ids).logits - reference)
                                   / torch.linalg.norm(reference)).item()
        found["generated"] = list(model.generate(input_ids=ids[:1, :4], min_new_tokens=3, max_new_tokens=3,
                                                 do_sample=False).shape)
    return found

for line in sys.stdin:
    try:
        found = check(json.loads(line))
    except Exception:
        found = {"error": traceback.format_exc()}
    print("ANSWER", json.dumps(found), flush=True)
"""


class FreshLoader:
    """Answers LOAD's requests in an interpreter that has never imported elastic_oneshot: one kept for the
    requests that change nothing in it (its imports, torch, transformers and compressed-tensors, cost more than
    the loads), and one of their own for those that teach transformers or register an architecture."""

    def __init__(self):
        self.proc, self.log = None, None

    def check(self, spec: dict) -> dict:
        if spec["teach"] or spec["prelude"]:
            proc = subprocess.run([sys.executable, "-c", LOAD], input=json.dumps(spec) + "\n", capture_output=True,
                                  text=True)
            return self._answer(proc.stdout.splitlines(), proc.stderr)
        if self.proc is None or self.proc.poll() is not None:
            self.log = tempfile.TemporaryFile("w+")
            self.proc = subprocess.Popen([sys.executable, "-c", LOAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self.log, text=True)
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        lines = []
        while not (lines and lines[-1].startswith("ANSWER ")) and (line := self.proc.stdout.readline()):
            lines.append(line)
        self.log.seek(0)
        return self._answer(lines, self.log.read())

    def close(self):
        """End the kept interpreter (its stdin closed, it returns) and its log."""
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait()
            self.proc.stdout.close()
            self.log.close()
            self.proc = None

    @staticmethod
    def _answer(lines: list[str], stderr: str) -> dict:
        answers = [line for line in lines if line.startswith("ANSWER ")]
        assert answers, f"the loader gave no answer:\n{stderr[-3000:]}"
        found = json.loads(answers[-1].removeprefix("ANSWER "))
        assert "error" not in found, found.get("error")
        return found


_loader = FreshLoader()
atexit.register(_loader.close)


def _scheme(out: str):
    """The one scheme of the W4 checkpoint `out` (symmetric pack-quantized, as the sweep writes)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    with open(os.path.join(out, "config.json")) as f:
        quantization = json.load(f)["quantization_config"]
    (group,) = quantization["config_groups"].values()
    assert quantization["format"] == "pack-quantized" and group["weights"]["symmetric"], quantization
    return QuantizationScheme(targets=group["targets"], weights=QuantizationArgs(**group["weights"]))


def write_rtn(model: str, out: str, to: str) -> str:
    """The W4 checkpoint `out` (compressed from `model`) with every quantized weight rounded to nearest instead of
    solved: the original weight quantized with the scales `out` holds (the same qparams: the min-max observer
    computes them from the original weight, before GPTQ), packed by compressed-tensors' own compressor."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from safetensors.torch import save_file

    from elastic_oneshot.models.source import SourceModel

    scheme = _scheme(out)
    shutil.copytree(out, to)
    path = os.path.join(to, "model.safetensors")
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    modules = [k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")]
    original = SourceModel(model).read_stored([f"{m}.weight" for m in modules])
    for m in modules:
        rounded = PackedQuantizationCompressor.compress(
            {"weight": original[f"{m}.weight"], "weight_scale": tensors[f"{m}.weight_scale"]}, scheme)
        assert rounded["weight_packed"].shape == tensors[f"{m}.weight_packed"].shape
        tensors[f"{m}.weight_packed"] = rounded["weight_packed"]
    save_file(tensors, path, metadata)
    return to


def module_errors(model: str, out: str, rtn: str, ids: torch.Tensor) -> dict[str, tuple[float, float]]:
    """Each quantized Linear's relative output error on `ids` (its inputs from the original model, which names its
    modules as the checkpoint does), with the weights of `out` and of its round-to-nearest twin `rtn`: what GPTQ
    minimizes, module by module."""
    from compressed_tensors.compressors import PackedQuantizationCompressor

    scheme, original = _scheme(out), transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tensors = {path: load_file(os.path.join(path, "model.safetensors")) for path in (out, rtn)}
    names = [k.removesuffix(".weight_packed") for k in tensors[out] if k.endswith(".weight_packed")]
    inputs = {}
    hooks = [original.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: inputs.setdefault(n, a[0]))
             for n in names]
    with torch.no_grad():
        original(input_ids=ids)
    for hook in hooks:
        hook.remove()
    errors = {}
    for n in names:
        x = inputs[n]
        y = x @ original.get_submodule(n).weight.T
        weights = [PackedQuantizationCompressor.decompress({k.removeprefix(f"{n}."): v for k, v in t.items()
                                                            if k.startswith(f"{n}.")}, scheme)["weight"]
                   for t in tensors.values()]
        errors[n] = tuple((torch.linalg.norm(x @ w.T - y) / torch.linalg.norm(y)).item() for w in weights)
    return errors


def heldout(model: str) -> torch.Tensor:
    """The sweep's tokens for comparing logits: 8 x 64 of held-out text (blocks calibration never draws from)."""
    from elastic_oneshot.loop.data import heldout_samples

    return heldout_samples("builtin", transformers.AutoTokenizer.from_pretrained(model), 8, 64)


def check_compressed(model: str, out: str, auto_class: str = "AutoModelForCausalLM", teach: bool = False,
                     prelude: str | None = None) -> tuple[float, float]:
    """The sweep's checks of a W4 checkpoint compressed from `model` (tests/test_architectures.py), made as a user
    makes them, in an interpreter that has never imported elastic_oneshot (FreshLoader): transformers loads it (as
    `auto_class`) with nothing missing or unexpected, and it generates; so does its round-to-nearest twin
    (write_rtn, to OUT.rtn). `teach`: the README beside the checkpoint says to call
    `elastic_oneshot.teach_transformers` before loading, and the load does (the plain load first: it misses the
    fused experts); otherwise elastic_oneshot is never imported. `prelude`: a file run first (a user's registration
    of a new architecture). Returns the relative L2 errors of both checkpoints' logits against the original's, on
    `heldout` text."""
    readme = os.path.join(out, "README.md")
    says = os.path.exists(readme) and "teach_transformers" in open(readme).read()
    assert says == teach, f"{out}/README.md says to call teach_transformers: {says}, expected {teach}"
    spec = dict(model=model, gptq=out, rtn=write_rtn(model, out, f"{out}.rtn"), auto_class=auto_class, teach=teach,
                prelude=prelude, ids=heldout(model).tolist())
    found = _loader.check(spec)
    assert found["elastic_oneshot imported"] == teach
    for how in ("gptq", "rtn"):
        assert not found[how]["missing_keys"] and not found[how]["unexpected_keys"], (how, found[how])
    assert found["generated"] == [1, 7], found["generated"]
    if teach:  # needed: loaded untaught, the fused experts are missing and every per-expert tensor is unexpected
        with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
            per_expert = {k for k in f.keys() if re.search(r"\.experts\.\d+\.", k)}
        missing, unexpected = found["untaught"]["missing_keys"], found["untaught"]["unexpected_keys"]
        assert missing and all(re.search(r"\.experts\.[a-z_]+$", k) for k in missing), missing
        assert per_expert and set(unexpected) == per_expert, unexpected
    return found["gptq"]["error"], found["rtn"]["error"]
