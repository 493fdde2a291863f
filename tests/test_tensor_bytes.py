"""The state's safetensors bytes are safetensors' own, though copied by torch (tensor_bytes.py), and its digests
(hashed a slice at a time) xxhash's of the whole."""

import os

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


@pytest.mark.parametrize("size", [0, 1, DIGEST_SLICE, DIGEST_SLICE + 1, 3 * DIGEST_SLICE + 7])
def test_a_digest_in_slices_is_the_digest_of_the_whole(size):
    data = os.urandom(size)
    assert digest(data) == digest(memoryview(data)) == xxhash.xxh3_128_hexdigest(data)
