"""Whether the model on disk is still the one the committed layers were computed from (models/content.py says why).

Each commit records its layer's content digest and the stats of the shards every rank read the model from, checked
unchanged at that commit. A stat recorded in a commit of epoch E vouches for every layer committed in E or before:
every rank of E checked those layers against its files when E began (`changed`) and compared its own layers'
digests with rank 0's at each commit. So a shard whose stat a commit of E or later recorded needs no reading for a
layer committed in E; any other shard's layers are read and hashed. A node with its own copy of the model pays that
read once, at the first epoch it joins.
"""

import logging
import time

import xxhash

from elastic_oneshot.models.content import Content

log = logging.getLogger("elastic_oneshot")


def vouchers(manifests: dict[int, dict]) -> dict:
    """What the commits `manifests` (layer -> commit) record of the model: each layer's digest and commit epoch, and
    per epoch the stats its commits saw (file -> keys)."""
    layers, stats = {}, {}
    for layer, m in manifests.items():
        layers[layer] = (m["source"]["digest"], m["epoch"])
        seen = stats.setdefault(m["epoch"], {})
        for name, keys in m["source"]["stats"].items():
            seen.setdefault(name, set()).update(keys)
    return {"layers": layers, "stats": stats}


def changed(content: Content, vouched: dict, stats: dict[str, str]) -> tuple[int, str] | None:
    """The first committed layer whose content differs from the one it was committed from, with the shard that
    differs; None if none. `vouched`: `vouchers` of the commits; `stats`: Content.stats now."""
    began, read = time.perf_counter(), 0
    for layer, (digest, epoch) in sorted(vouched["layers"].items()):
        trusted = {}
        for e, seen in vouched["stats"].items():
            if e >= epoch:
                for name, keys in seen.items():
                    trusted.setdefault(name, set()).update(keys)
        files = content.files(layer)
        if all(stats.get(name) in trusted.get(name, ()) for name in files):
            continue
        read += 1
        if content.digest(layer) != digest:
            untrusted = [name for name in files if stats.get(name) not in trusted.get(name, ())]
            return layer, ", ".join(untrusted)
    if read:
        log.info("%d committed layers checked against the model's files (%d read and hashed) in %.1f s",
                 len(vouched["layers"]), read, time.perf_counter() - began)
    return None


def record(digest: str, stats: list[dict[str, str]]) -> dict:
    """A commit's "source": the layer's digest, and every rank's stat of each shard (file -> sorted keys)."""
    keys: dict[str, set] = {}
    for rank_stats in stats:
        for name, key in rank_stats.items():
            keys.setdefault(name, set()).add(key)
    return {"digest": digest, "stats": {name: sorted(k) for name, k in sorted(keys.items())}}


def lineage(digests: list[str]) -> str:
    """What a layer's solved groups were computed from, given the content digests of every layer up to it."""
    return xxhash.xxh3_128_hexdigest("/".join(digests).encode())
