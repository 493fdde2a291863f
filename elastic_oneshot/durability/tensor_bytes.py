"""A safetensors file's bytes, the same bytes as `safetensors.torch.save` gives, copied by numpy; and tensors read
from such bytes without copying them.

Commits and boundaries are serialized on I/O threads while the main thread solves the next layer. safetensors'
writer holds the GIL for the whole copy, so every torch call of the solver (each releases and retakes the GIL) waits
for it: a data-free pass spent more time waiting than computing. Here the tensors' bytes are copied by numpy, which
releases the GIL and copies on this thread alone (torch's copy_ would take the solver's intra-op threads), into one
uninitialized buffer (a bytearray would be zeroed first, holding the GIL), which is written as it is (no copy into a
`bytes` after it). The committed layers the export writes out are read as views of the bytes read (`load`), where
safetensors' `load` copies each tensor.
"""

import json
import struct
import warnings

import numpy
import torch
from safetensors.torch import _TYPES

_NAMES = {dtype: name for name, dtype in _TYPES.items()}  # safetensors' own dtype names
METADATA = {"format": "pt"}  # what every file of the state and the checkpoint says it holds, as transformers writes
# The order of safetensors' Dtype, by which its writer lays out the tensors (the largest first, then by name).
_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32",
          "U32", "F32", "C64", "F64", "I64", "U64")


def save(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> memoryview:
    """`safetensors.torch.save(tensors, metadata)`'s bytes, in a buffer of their own."""
    entries, text = _layout(tensors, metadata)
    out = numpy.empty(len(text) + sum(t.nbytes for _, t in entries), dtype=numpy.uint8)
    out[:len(text)] = numpy.frombuffer(text, dtype=numpy.uint8)
    at = len(text)
    for _, t in entries:
        if t.nbytes:
            numpy.copyto(out[at:at + t.nbytes], t.detach().cpu().reshape(-1).view(torch.uint8).numpy())
            at += t.nbytes
    return memoryview(out)


def saved_as(data: bytes | memoryview, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bool:
    """Whether `data`, safetensors bytes that hold exactly `tensors`' bytes, are `save(tensors, metadata)`: the same
    header (names, dtypes, shapes, order, metadata), checked without a copy of the data."""
    text = _layout(tensors, metadata)[1]
    return bytes(memoryview(data)[:len(text)]) == text and len(data) == len(text) + sum(t.nbytes for t in
                                                                                         tensors.values())


def _layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> tuple[list, bytes]:
    """The tensors in the order safetensors' writer lays them out, and the bytes before their data (the header's
    length, the header, its padding)."""
    entries = sorted(tensors.items(), key=lambda item: (-_ORDER.index(_NAMES[item[1].dtype]), item[0]))
    header, end = {} if metadata is None else {"__metadata__": metadata}, 0
    for name, t in entries:
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [end, end + t.nbytes]}
        end += t.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    return entries, struct.pack("<Q", len(text)) + text


def load(data: bytes | memoryview) -> dict[str, torch.Tensor]:
    """The tensors of safetensors bytes, as views of `data` (which they keep alive), not copies: read-only where
    `data` is (torch warns once that such a buffer is not writable; nothing here writes into it)."""
    view = memoryview(data)
    (size,) = struct.unpack("<Q", view[:8])
    header = json.loads(bytes(view[8:8 + size]))
    header.pop("__metadata__", None)
    out = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for name, info in header.items():
            dtype, (start, stop) = _TYPES[info["dtype"]], info["data_offsets"]
            out[name] = torch.frombuffer(view, dtype=torch.uint8, count=stop - start, offset=8 + size + start) \
                .view(dtype).reshape(info["shape"]) if stop > start else torch.empty(info["shape"], dtype=dtype)
    return out
