"""loop/device_cache.py: what AWQ caches on the device for a layer stays within the run's budget, then within the
host's, then goes to a file; where a tensor is held changes no bits. A record that would not fit even on the disk is
refused after its first sample (a temporary directory in memory counting as none)."""

import contextlib
import errno
import logging
import math
import os
import shutil
import subprocess

import pytest
import torch

from elastic_oneshot.distributed.world import World
from elastic_oneshot.errors import UsageError
from elastic_oneshot.loop import layer_step
from elastic_oneshot.loop.device_cache import DeviceCache, in_memory, tensor_ids
from elastic_oneshot.loop.passes import plan
from elastic_oneshot.models.source import Embedder, SourceModel
from elastic_oneshot.quantization import awq
from elastic_oneshot.quantization.recipe_loader import read_recipe
from elastic_oneshot.testing.recipes import recipe_yaml
from elastic_oneshot.testing.tiny import make_moe


def test_the_cache_holds_up_to_its_allowance_and_brings_back_exact_copies():
    torch.manual_seed(0)
    shared = (torch.randn(1024), torch.randn(8))  # a layer's keyword arguments: held anyway, never counted
    calls = [{"x": torch.randn(1024), "rows": [torch.randn(16)], "position_embeddings": shared, "n": 3}
             for _ in range(5)]
    cache = DeviceCache("cpu", 3 * (1024 + 16) * 4)  # three calls' own tensors
    kept = [cache.keep(c, tensor_ids(shared)) for c in calls]
    assert [type(k["x"]) is torch.Tensor for k in kept] == [True] * 3 + [False] * 2
    assert kept[4]["position_embeddings"][0] is shared[0] and kept[4]["n"] == 3
    assert cache.spilled == 2 * (1024 + 16) * 4 and cache.left == 0
    for call, k in zip(calls, kept):
        back = cache.use(k)
        assert torch.equal(back["x"], call["x"]) and torch.equal(back["rows"][0], call["rows"][0])
        assert back["position_embeddings"][1] is shared[1]
    assert cache.use(kept[0])["x"] is calls[0]["x"]  # held: not copied


def test_past_the_host_allowance_the_cache_writes_a_file_and_reads_back_exact_copies(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    torch.manual_seed(0)
    calls = [{"x": torch.randn(256, dtype=dtype), "n": torch.tensor(i)} for i, dtype in
             enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16])]
    cache = DeviceCache("cpu", 256 * 4 + 8, host_allowance=256 * 2 + 8)  # the first call held, the second copied
    kept = [cache.keep(c) for c in calls]
    assert [type(k["x"]).__name__ for k in kept] == ["Tensor", "_Spilled", "_OnDisk", "_OnDisk", "_OnDisk"]
    assert cache.on_host == 256 * 2 + 8 and cache.on_disk == 256 * (2 + 4 + 2) + 3 * 8 and cache.kept == sum(
        t.nbytes for c in calls for t in c.values())
    assert os.listdir(tmp_path) == []  # the file is unlinked: nothing is left behind by a kill
    for call, k in reversed(list(zip(calls, kept))):  # read back in any order
        back = cache.use(k)
        assert back["x"].dtype == call["x"].dtype and torch.equal(back["x"], call["x"])
        assert back["n"].shape == () and torch.equal(back["n"], call["n"])
    rest = cache.rest()
    assert (rest.left, rest.host_left) == (cache.left, cache.host_left) == (0, 0)
    monkeypatch.setattr(os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left")))
    with pytest.raises(OSError) as full:
        rest.keep(calls[0])
    assert (full.value.errno, full.value.filename) == (errno.ENOSPC, str(tmp_path))  # the file has no name of its own


def awq_layer(family: str, tiny_llama, tmp_path):
    """AWQ's pass over layer 0 of a tiny `family` model: the source, its step's inputs, and `decide` (the tensors
    the step decided and the layer's weights after it)."""
    path = tiny_llama if family == "llama" else make_moe(str(tmp_path / "moe"))
    source = SourceModel(path)
    recipe = read_recipe(recipe_yaml("awq_w4a16_asym", moe=family != "llama", group=16)).with_default_mappings(
        source.family, source.config)
    schemes = recipe.module_schemes(source.skeleton, source.family)
    passes = plan(recipe, source, schemes)
    samples, seq_len = 6, 24
    torch.manual_seed(1)
    x = torch.randn(samples, seq_len, source.config.hidden_size, dtype=source.dtype)
    kwargs = Embedder(source).layer_kwargs(0, 1, seq_len)

    def decide() -> tuple[dict, dict]:
        step = layer_step.LayerStep(source, schemes, recipe, World(), "cpu", seq_len, samples, False, passes, 0,
                                    [(0, 3), (3, 6)])
        module, units = step.load(0, None, {})
        tensors = {}
        step.decide(0, module, units, tensors, lambda: [(0, x[:3]), (1, x[3:])], lambda: kwargs, {},
                    lambda names, found: None, budget=2**30)
        return tensors, module.state_dict()
    return decide


@pytest.mark.parametrize("family, tiers", [("llama", (0, math.inf)), ("qwen3_moe", (0, math.inf)),
                                           ("llama", (0, 0))])
def test_awq_chooses_the_same_scales_with_its_calls_out_of_the_device(family, tiers, tiny_llama, tmp_path,
                                                                       monkeypatch, caplog):
    """AWQ's layer step on layer 0, its recorded calls and reference outputs all kept in the cache, or all copied
    out of it to the host (as a GPU over its budget would), or all to a file (past the host's): the same errors at
    every grid point computed, the same scales, bit for bit, and the same weights after the folds."""
    decide = awq_layer(family, tiny_llama, tmp_path)
    errors, sample_errors = [], awq.sample_errors
    monkeypatch.setattr(awq, "sample_errors", lambda *a: errors.append(sample_errors(*a)) or errors[-1])
    held, weights = decide()
    held_errors = torch.cat(errors)
    errors.clear()
    monkeypatch.setattr(layer_step, "_cache_allowances", lambda module, budget, device: tiers)
    written, write = [], DeviceCache._write
    monkeypatch.setattr(DeviceCache, "_write", lambda self, t: written.append(t.nbytes) or write(self, t))
    with caplog.at_level(logging.INFO, logger="elastic_oneshot"):
        spilled, spilled_weights = decide()
    spilled_errors = torch.cat(errors)
    assert bool(written) == (tiers[1] == 0)
    assert "of its recorded calls in host memory and" in caplog.text
    assert held.keys() == spilled.keys() and any(t.numel() for t in held.values())
    assert torch.equal(held_errors, spilled_errors)  # each grid point's error of each sample: a copy is exact
    assert all(torch.equal(held[k], spilled[k]) for k in held)
    assert all(torch.equal(weights[k], spilled_weights[k]) for k in weights)


@contextlib.contextmanager
def tmpfs(path, size: str = "64m"):
    """A file system in memory mounted at `path` (made here) for the block."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")
def test_awq_refuses_a_record_that_memory_and_the_disk_cannot_hold_after_its_first_sample(tiny_llama, tmp_path,
                                                                                         monkeypatch):
    """Every sample's calls have the same shapes: once the first is recorded, a record that would outgrow what the
    cache may hold and this rank's share of the temporary directory's free space is refused, before the other
    samples are run. The ranks of a host share its disk; a temporary directory in memory (tmpfs) offers none, its
    room being the memory the allowances count."""
    decide = awq_layer("llama", tiny_llama, tmp_path)
    monkeypatch.setattr(layer_step, "_cache_allowances", lambda module, budget, device: (0, 0))
    kept, keep = [], DeviceCache.keep
    monkeypatch.setattr(DeviceCache, "keep", lambda self, obj, shared=frozenset(): kept.append(1) or
                        keep(self, obj, shared))
    recorded, search = [], layer_step.LayerStep._search
    monkeypatch.setattr(layer_step.LayerStep, "_search", lambda self, *a: recorded.append(len(kept)) or
                        search(self, *a))
    fits, per_sample = layer_step.LayerStep._record_fits, []  # per sample: (its record, its largest output)
    monkeypatch.setattr(layer_step.LayerStep, "_record_fits", lambda self, layer, cache, reference: per_sample.append(
        (cache.kept, reference)) or fits(self, layer, cache, reference))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    disk, usage = (tmp_path / "disk"), shutil.disk_usage
    disk.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(disk))
    if in_memory(str(disk)):
        pytest.skip(f"{tmp_path} is in memory: the test needs a temporary directory on a disk")
    decide()
    (record, reference), = set(per_sample)
    assert 0 < reference < record  # the attention's and the MLP's outputs: the hidden size per token
    free = {str(disk): 7 * (record + reference)}  # with the first sample's record in the file: 4.5 each of two ranks
    monkeypatch.setattr("shutil.disk_usage", lambda path: type("usage", (), {"free": free[path]}) if path in free
                        else usage(path))
    decide()  # alone on the host: the record fits

    def refused(local: str, where: str, room: str):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        monkeypatch.setattr("tempfile.tempdir", where)
        kept.clear()
        with pytest.raises(UsageError, match=r"^layer 0: AWQ's record of its calls on rank 0 would take .* GB \(6 "
                                             r"samples of .* GB, with the outputs its search keeps\), more than the "
                                             rf".* GB of memory {room}: run on more ranks .*, or with TMPDIR on a"):
            decide()
        assert len(kept) == recorded[0] // 6  # the first sample's calls (one per parent), then the refusal

    refused("2", str(disk), rf"and the .* GB of disk in {disk} it may use \(its share: 2 ranks on this host "
                            r"record at once\)")
    free[str(disk)] = 5 * record  # the record alone would fit (the first sample's and 5 more), not with its outputs
    refused("1", str(disk), rf"and the .* GB of disk in {disk} it may use")
    free[str(disk)] = 1000
    refused("1", str(disk), rf"and the .* GB of disk in {disk} it may use")
    with tmpfs(tmp_path / "memory") as memory:  # 64 MiB free: room for the whole record, were it a disk
        refused("1", memory, rf"it may use \({memory}, the temporary directory, is in memory too\)")


def test_a_file_system_in_memory_is_known_by_its_mount(tmp_path):
    assert not in_memory("/proc/self") and not in_memory("/nonexistent")
    if os.geteuid() == 0:
        with tmpfs(tmp_path / "in memory") as memory:  # its mount point written with an escape (\\040)
            assert in_memory(memory) and in_memory(os.path.join(memory, "a", "b"))
            assert not in_memory(memory + "2") or in_memory(str(tmp_path))  # beside it, not in it
