"""The state's safetensors bytes are safetensors' own, though copied by numpy (tensor_bytes.py); what the export
reads back is views of those bytes; and the state's digests (hashed a slice at a time) are xxhash's of the whole."""

import os

import numpy
import pytest
import torch
import xxhash
from safetensors.torch import _TYPES, load, save

from elastic_oneshot.durability import tensor_bytes
from elastic_oneshot.durability.state import DIGEST_SLICE, digest


def every_kind() -> dict[str, torch.Tensor]:
    """A tensor of every dtype safetensors writes, in several shapes (a scalar, an empty one, a transposed one), under
    names that sort apart from their dtypes' order, one of them not ASCII."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, (name, dtype) in enumerate(sorted(_TYPES.items())):
        for j, shape in enumerate([(3,), (2, 5), (), (0, 4), (7, 1, 3)]):
            codes = torch.randint(0, 120, shape, generator=g, dtype=torch.int64)
            out[f"{chr(ord('z') - i)}{j}.{name}.é"] = codes.to(torch.uint8).view(dtype) if dtype.itemsize == 1 \
                else codes.to(dtype)
    out["transposed"] = torch.arange(20.0).reshape(4, 5).t()
    return out


def test_the_bytes_are_safetensors_own():
    tensors = every_kind()
    ours = tensor_bytes.save(tensors)
    assert ours.tobytes() == save({k: v.contiguous() for k, v in tensors.items()})
    back = load(ours.tobytes())
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k].reshape(-1).view(torch.uint8), tensors[k].reshape(-1).view(torch.uint8))
               for k in tensors)
    assert tensor_bytes.save({}).tobytes() == save({})


def test_with_metadata_the_bytes_are_safetensors_own_and_known_by_their_header():
    """With the metadata every state file and checkpoint shard carries: safetensors' bytes; `saved_as` tells them
    from bytes with other names, dtypes, metadata or length, from their header alone."""
    tensors = every_kind()
    theirs = save({k: v.contiguous() for k, v in tensors.items()}, metadata=tensor_bytes.METADATA)
    assert tensor_bytes.save(tensors, tensor_bytes.METADATA).tobytes() == theirs
    assert tensor_bytes.saved_as(theirs, tensors, tensor_bytes.METADATA)
    # each as long as the file, but for the last two
    renamed = {k.replace("transposed", "transposeD"): v for k, v in tensors.items()}
    reshaped = {**tensors, "transposed": tensors["transposed"].reshape(2, 10)}
    for data, held, metadata in ((theirs, tensors, {"format": "tf"}), (theirs, renamed, tensor_bytes.METADATA),
                                 (theirs, reshaped, tensor_bytes.METADATA), (theirs, tensors, None),
                                 (theirs + b"\0", tensors, tensor_bytes.METADATA)):
        assert not tensor_bytes.saved_as(data, held, metadata)


def test_bytes_load_back_as_views_of_themselves():
    """`load` gives the tensors of safetensors' bytes back, as views of those bytes, not copies."""
    tensors = every_kind()
    data = save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": "pt"})
    back = tensor_bytes.load(data)
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape
        assert torch.equal(back[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    buffer = numpy.frombuffer(data, dtype=numpy.uint8).ctypes.data
    assert all(buffer <= t.data_ptr() < buffer + len(data) for t in back.values() if t.numel())
    assert tensor_bytes.load(save({})) == {}


@pytest.mark.parametrize("size", [0, 1, DIGEST_SLICE, DIGEST_SLICE + 1, 3 * DIGEST_SLICE + 7])
def test_a_digest_in_slices_is_the_digest_of_the_whole(size):
    data = os.urandom(size)
    assert digest(data) == digest(memoryview(data)) == xxhash.xxh3_128_hexdigest(data)
