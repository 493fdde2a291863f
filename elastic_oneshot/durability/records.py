"""The records: where the truth of a job's progress lives, its epoch fences and layer commits.

Two backends declare the one interface, `Records`: `FileRecords`, files in the state directory (the default;
docs/state-format.md), and `etcd_records.EtcdRecords` (`--coordinator etcd://...`). `coordinator.open_records`
picks one for a state directory. The weights, boundaries and events a commit names are files in the state directory
either way (state.StateStore); the records only say which of them are valid.
"""

import abc
import time
import uuid
from collections.abc import Iterator

from elastic_oneshot.durability import layout
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.errors import CorruptStateError, StaleEpochError


class Records(abc.ABC):
    """Epoch fences and layer commits. What only some backends need (a job owning shared keys, a rank's lease,
    a progress key to watch) has a default here that does nothing."""

    url: str | None = None  # the coordinator's URL, without its password, as job.json records it; None: files

    def __init__(self):
        self._tags: dict[int, str] = {}  # epoch -> its tag, as read or made by this process

    @abc.abstractmethod
    def epochs(self) -> list[int]:
        """Every epoch begun (that the records still hold), oldest first."""

    @abc.abstractmethod
    def current_epoch(self) -> int:
        """The newest epoch; 0 before the first."""

    @abc.abstractmethod
    def fence(self, epoch: int) -> dict | None:
        """Epoch `epoch`'s fence, {"epoch", "committed": {"layer": epoch}, "nonce", ...}; None if absent."""

    def tag(self, epoch: int) -> str | None:
        """Epoch `epoch`'s tag (layout.tag), under which its workers write; None if its fence is absent or unreadable
        (then nothing written under it is taken). Read once: a fence never changes once created."""
        if epoch not in self._tags:
            found = self._read_tag(epoch)
            if found is None:
                return None
            self._tags[epoch] = found
        return self._tags[epoch]

    def _read_tag(self, epoch: int) -> str | None:
        try:
            fence = self.fence(epoch)
        except CorruptStateError:
            return None
        return layout.tag(epoch, fence["nonce"]) if fence and fence.get("nonce") else None

    @abc.abstractmethod
    def committed(self) -> dict[int, int]:
        """Layer -> epoch of its valid commit: the newest fence's list, plus that epoch's own commits."""

    @abc.abstractmethod
    def begin_epoch(self, committed: dict[int, int]) -> int:
        """Fence a new epoch and return it: commits not in `committed` (layer -> epoch) are invalid from now on.
        StaleEpochError if another process began it first."""

    @abc.abstractmethod
    def manifest(self, layer: int, epoch: int) -> dict | None:
        """What layer `layer`'s commit in `epoch` names (its weight and boundary files); None if absent."""

    @abc.abstractmethod
    def commit(self, layer: int, epoch: int, manifest: dict):
        """Commit layer `layer` for `epoch` with `manifest`; StaleEpochError once a newer epoch has begun, or if
        this epoch already committed it."""

    def claim(self, record: dict, state_root: str):  # noqa: B027  (deliberately nothing)
        """The job `record` (job.json's body) starts afresh in `state_root`: drop any other job's records."""

    def adopt(self, record: dict, state_root: str):  # noqa: B027  (deliberately nothing)
        """The job `record` resumes in `state_root`: make sure the records are its own."""

    def attach(self, rank: int, world_size: int | None = None, layers_total: int | None = None):  # noqa: B027  (deliberately nothing)
        """This process works as rank `rank` until detach()."""

    def detach(self):  # noqa: B027  (deliberately nothing)
        """This process no longer works on the job. Never raises."""

    def watch_progress(self, timeout: float | None = None, interval: float = 0.5) -> Iterator[dict | None]:
        """The progress at each change, until the job is done or `timeout` seconds have passed. Records that keep
        no progress of their own wait `timeout` (or `interval` without one) and yield None: reread the state."""
        time.sleep(interval if timeout is None else timeout)
        yield None


class FileRecords(Records):
    """Epoch fences and commits as files in the state directory (state.py's docstring has the layout):
    epochs/EEEEE.json, created once (link(2), or a conditional put on an object store), and
    commits/LLLLL.eEEEEE.json, created once while E is newest. A list that misses the newest fence or a commit
    (an eventually consistent store) costs a refused fence or a layer redone, never a wrong commit."""

    def __init__(self, files: StateStore):
        super().__init__()
        self.files = files

    def epochs(self) -> list[int]:
        return sorted(e for n in self.files.names(layout.EPOCHS) if (e := layout.fenced(n)) is not None)

    def current_epoch(self) -> int:
        return (self.epochs() or [0])[-1]

    def fence(self, epoch: int) -> dict | None:
        """CorruptStateError if the fence file is unreadable."""
        return self.files.read_json(layout.fence(epoch))

    def committed(self) -> dict[int, int]:
        """If the newest fence is unreadable, an older one is used and the commits in between are not trusted
        (their layers are redone)."""
        epochs = self.epochs()
        epoch = (epochs or [0])[-1]
        view = {}
        for e in reversed(epochs):
            try:
                view = {int(k): v for k, v in self.fence(e)["committed"].items()}
                break
            except (CorruptStateError, KeyError, TypeError):
                continue
        for name in self.files.names(layout.COMMITS):
            if (layer := layout.committed(name, epoch)) is not None:
                view[layer] = epoch
        return view

    def begin_epoch(self, committed: dict[int, int]) -> int:
        epoch, nonce = self.current_epoch() + 1, uuid.uuid4().hex
        try:
            self.files.write_json(layout.fence(epoch), {"epoch": epoch, "nonce": nonce, "committed": {
                str(k): v for k, v in sorted(committed.items())}}, exclusive=True)
        except FileExistsError:
            raise StaleEpochError(f"epoch {epoch} was begun by another process") from None
        self._tags[epoch] = layout.tag(epoch, nonce)
        return epoch

    commit_path = staticmethod(layout.commit)

    def manifest(self, layer: int, epoch: int) -> dict | None:
        return self.files.read_json(layout.commit(layer, epoch))

    def commit(self, layer: int, epoch: int, manifest: dict):
        """Also refused unless the fence of `epoch` here is the one this process created: a state reached through a
        path that now leads elsewhere (a re-pointed link, a remount, another copy) is found within a layer."""
        current = self.current_epoch()
        if current != epoch:
            raise StaleEpochError(f"epoch {epoch} is stale (epoch {current} has begun): layer {layer} not committed")
        mine = self._tags.get(epoch)
        if mine is None or self._read_tag(epoch) != mine:
            raise StaleEpochError(f"the fence of epoch {epoch} in {self.files.root} is not the one this process "
                                  f"began (the state's path leads elsewhere now): layer {layer} not committed")
        try:
            self.files.write_json(layout.commit(layer, epoch), manifest, exclusive=True)
        except FileExistsError:
            raise StaleEpochError(f"layer {layer} was already committed in epoch {epoch}") from None
