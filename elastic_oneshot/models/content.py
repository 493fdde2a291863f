"""What the committed layers were computed from: a digest of each layer's stored tensors, and the stats of the shard
files that spare reading them again while they are untouched.

job.json's identity holds the shards' headers (names, dtypes, shapes), so a model edited in place (a fine-tune or a
new revision saved over it) keeps the job's fingerprint. So each layer's commit also records the digest of the bytes
its layer was computed from (layer 0's covers the decoder's tensors outside its layers too, the embeddings first:
every layer's inputs depend on them), and the stats of the shards every rank read them from. A restart trusts a
shard whose stat a commit recorded (runner.py says which commits vouch for which layers) and reads and hashes the
layers of any other shard. An in-place edit changes a file's ctime (which no tool sets back), a new copy its inode.
"""

import json
import os

import xxhash

from elastic_oneshot.models.source import SourceModel, _read_header

READ = 256 << 10  # bytes per read while hashing: xxhash holds the GIL while it hashes one


class Content:
    """The digests and file stats of `source`'s decoder layers, as they are on disk now."""

    def __init__(self, source: SourceModel):
        self.source = source
        self._names: dict[int, tuple[str, ...]] = {}

    def names(self, layer: int) -> tuple[str, ...]:
        """The checkpoint's tensors layer `layer` is computed from (stored names; a fused experts tensor once)."""
        if layer not in self._names:
            self._names[layer] = self._stored(layer)
        return self._names[layer]

    def _stored(self, layer: int) -> tuple[str, ...]:
        source = self.source
        skeleton = [f"{source.layer_prefix}{layer}.{k}" for k in source.layers[layer].state_dict()]
        if layer == 0:
            decoder = next(n for n, m in source.skeleton.named_modules() if m is source.decoder)
            skeleton += [f"{decoder}.{k}".lstrip(".") for k in source.decoder.state_dict()
                         if not k.startswith(f"{source.family.stack}.")]
        # as stored (in parts, or fused); not buffers built from the config, nor tied names the checkpoint omits
        stored = {n for name in skeleton for n in source.stored_sources(name) if n in source.files}
        return tuple(sorted(stored))

    def files(self, layer: int) -> list[str]:
        """The shard files holding layer `layer`'s tensors, by file name."""
        return sorted({os.path.basename(self.source.files[n]) for n in self.names(layer)})

    def digest(self, layer: int) -> str:
        """xxh3-128 of the names and bytes of layer `layer`'s stored tensors, read from the shards."""
        h, buffer = xxhash.xxh3_128(), bytearray(READ)  # read into one buffer: no allocation, no page faults per read
        by_file: dict[str, list[str]] = {}
        for name in self.names(layer):
            by_file.setdefault(self.source.files[name], []).append(name)
        for path in sorted(by_file):
            header = _read_header(path)
            entries = json.loads(header)
            with open(path, "rb") as f:
                for name in sorted(by_file[path], key=lambda n: entries[n]["data_offsets"][0]):
                    start, end = entries[name]["data_offsets"]
                    h.update(name.encode())
                    position = 8 + len(header) + start
                    while position < 8 + len(header) + end:
                        view = memoryview(buffer)[:min(READ, 8 + len(header) + end - position)]
                        n = os.preadv(f.fileno(), [view], position)
                        if not n:
                            raise OSError(f"{path} ends before tensor {name}")
                        h.update(view[:n])
                        position += n
        return h.hexdigest()

    def stats(self) -> dict[str, str]:
        """Each shard's file name -> its stat as a key: size, mtime, ctime and inode (any write or replacement
        changes one of them)."""
        out = {}
        for path in sorted(set(self.source.files.values())):
            st = os.stat(path)
            out[os.path.basename(path)] = f"{st.st_size}.{st.st_mtime_ns}.{st.st_ctime_ns}.{st.st_ino}"
        return out
