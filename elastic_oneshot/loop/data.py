"""Calibration text -> fixed-length token samples -> fixed chunks -> a rank's share.

Documents are tokenized, joined with EOS and cut into blocks of `seq_len` tokens, so every sample is
full length: no padding, one attention shape, and chunk files whose size does not depend on anything
but the job. Every tenth block is held out for evaluation; the calibration samples are drawn from the
rest with a seeded generator.
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
from typing import TYPE_CHECKING

from elastic_oneshot.errors import UsageError

if TYPE_CHECKING:  # imported where used: a restart partitions its chunks before torch is imported (read_ahead.py)
    import torch

HOLDOUT_EVERY = 10  # block i is held out for evaluation when i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1
POOL_FACTOR = 4  # read until the calibration pool holds this many times the samples asked for


def builtin_texts():
    """Docstrings of the standard library: real English prose on every machine with Python. Files are
    parsed as the reader asks for more: parsing them all takes seconds, and a job reads a fraction."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"test", "tests", "site-packages", "idlelib", "lib2to3", "__pycache__", "turtledemo",
            "ensurepip", "dist-packages"}
    found = False
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("config-"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= 200:
                        found = True
                        yield doc
    if not found:
        raise UsageError(f"no docstrings found under {root}: the builtin dataset needs the standard "
                         "library's sources")


def iter_texts(spec: str, text_column: str = "text"):
    """Yield documents from `builtin`, a local file or saved dataset, or a hub dataset name."""
    if spec == "builtin":
        yield from builtin_texts()
        return
    import datasets

    datasets.disable_progress_bars()  # its bars would interleave with ours, and with a one-line error
    if os.path.isdir(spec):
        try:
            ds = datasets.load_from_disk(spec)
        except FileNotFoundError as e:
            raise UsageError(f"{spec} is not a directory written by datasets.save_to_disk") from e
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else ds[sorted(ds)[0]]
    elif os.path.isfile(spec):
        ext = spec.rsplit(".", 1)[-1].lower()
        loader = {"jsonl": "json", "json": "json", "txt": "text", "text": "text", "parquet": "parquet"}
        if ext not in loader:
            raise UsageError(f"unsupported dataset file {spec}: use .jsonl, .json, .txt or .parquet")
        _check_file(spec, loader[ext])
        try:
            ds = datasets.load_dataset(loader[ext], data_files=spec, split="train")
        except Exception as e:  # datasets wraps the parser's error; its cause is what the user can act on
            cause = e.__cause__ or e
            raise UsageError(f"cannot read dataset {spec} ({type(cause).__name__}: "
                             f"{(str(cause).splitlines() or [''])[0]})") from None
    elif spec.startswith(("/", ".", "~")) or spec.endswith((".jsonl", ".json", ".txt", ".parquet")):
        raise UsageError(f"dataset {spec} does not exist")
    else:
        name, _, split = spec.partition(":")
        try:
            ds = datasets.load_dataset(name, split=split or "train", streaming=True)
        except Exception as e:  # the hub raises many kinds; all mean the same thing to the user
            raise UsageError(f"dataset {spec!r} is neither a local path nor a reachable hub "
                             f"dataset ({type(e).__name__})") from e
    columns = ds.column_names or []
    if text_column not in columns:
        raise UsageError(f"dataset {spec} has no column {text_column!r} (columns: "
                         f"{', '.join(columns)}); choose one with --text-column")
    for i, row in enumerate(ds):
        if row[text_column] and not isinstance(row[text_column], str):
            raise UsageError(f"dataset {spec} row {i}: column {text_column!r} holds "
                             f"{type(row[text_column]).__name__}, not text; choose one with --text-column")
        if row[text_column]:
            yield row[text_column]


def _check_file(spec: str, kind: str):
    """An empty file or a line that is not JSON, named, rather than an error from inside `datasets`."""
    if os.path.getsize(spec) == 0:
        raise UsageError(f"dataset {spec} is empty: give a file with text")
    if kind == "parquet":
        return
    with open(spec, "rb") as f:
        if not any(line.strip() for line in f):
            raise UsageError(f"dataset {spec} has no text (only blank lines): give a file with text")
    if kind != "json":
        return
    with open(spec, encoding="utf-8", errors="replace") as f:
        if spec.lower().endswith(".json"):  # one JSON document, or JSON lines under a .json name
            try:
                json.load(f)
                return
            except ValueError:
                f.seek(0)
        for number, line in enumerate(f, 1):
            try:
                if line.strip():
                    json.loads(line)
            except ValueError as e:
                raise UsageError(f"dataset {spec} line {number} is not valid JSON ({e}): "
                                 "fix or remove it") from None


def token_blocks(spec, tokenizer, seq_len: int, text_column: str, want_calib: int,
                 want_holdout: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut the dataset's token stream into blocks; return (calibration pool, held-out blocks).

    Reading stops once the pool holds POOL_FACTOR * want_calib blocks and want_holdout blocks are
    held out, so a large dataset is not tokenized in full.
    """
    import torch

    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    buf: list[int] = []
    pool, holdout = [], []
    n_blocks = 0

    def enough():
        return len(pool) >= POOL_FACTOR * want_calib and len(holdout) >= want_holdout

    batch = []
    texts = iter_texts(spec, text_column)
    while not enough():
        batch = [t for _, t in zip(range(64), texts)]
        if not batch:
            break
        for ids in tokenizer(batch)["input_ids"]:
            buf.extend(ids)
            buf.extend(eos)
        while len(buf) >= seq_len:
            block, buf = buf[:seq_len], buf[seq_len:]
            (holdout if n_blocks % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 else pool).append(block)
            n_blocks += 1

    def as_tensor(blocks):
        return torch.tensor(blocks, dtype=torch.int64).reshape(-1, seq_len)
    return as_tensor(pool), as_tensor(holdout[:want_holdout])


def calibration_samples(spec, tokenizer, num_samples: int, seq_len: int, seed: int,
                        text_column: str = "text") -> torch.Tensor:
    """`num_samples` blocks of `seq_len` tokens, chosen from the pool by a seeded permutation."""
    pool, _ = token_blocks(spec, tokenizer, seq_len, text_column, num_samples, 0)
    if len(pool) < num_samples:
        raise UsageError(f"dataset {spec} yields only {len(pool)} usable samples of {seq_len} tokens "
                         f"(every {HOLDOUT_EVERY}th held out); asked for {num_samples}: lower "
                         "--num-samples or --seq-len, or use more text")
    import torch

    order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed))
    return pool[order[:num_samples].sort().values]


def heldout_samples(spec, tokenizer, num_samples: int, seq_len: int,
                    text_column: str = "text") -> torch.Tensor:
    _, holdout = token_blocks(spec, tokenizer, seq_len, text_column, 0, num_samples)
    if len(holdout) == 0:
        raise UsageError(f"dataset {spec} is too small to hold out a sample of {seq_len} tokens")
    return holdout


def chunk_bounds(num_samples: int, chunk_size: int) -> list[tuple[int, int]]:
    """Sample ranges of the fixed chunks; they never depend on the world size."""
    return [(s, min(s + chunk_size, num_samples)) for s in range(0, num_samples, chunk_size)]


def partition(num_chunks: int, world_size: int, rank: int) -> range:
    """This rank's contiguous, balanced slice of chunk ids (sizes differ by at most one)."""
    return range(rank * num_chunks // world_size, (rank + 1) * num_chunks // world_size)


def own_chunks(num_samples: int, chunk_size: int, world_size: int, rank: int) -> list[int]:
    """The ids of the chunks rank `rank` of `world_size` calibrates and propagates."""
    return list(partition(len(chunk_bounds(num_samples, chunk_size)), world_size, rank))
