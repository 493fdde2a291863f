"""Which records a state's job keeps: files in the state directory, or an etcd coordinator (`--coordinator`)."""

import urllib.parse

from elastic_oneshot.durability import layout
from elastic_oneshot.durability.records import FileRecords, Records
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.errors import CorruptStateError


def open_records(state: StateStore, coordinator: str | None = None, stage: str | None = None) -> Records:
    """The records of the job in `state`: in etcd at `coordinator` if given, else at the coordinator job.json
    records (so that export, status and a resume find them there), else files in the state directory. `stage`: those
    of the recipe's pass in that folder (layout.stage): files in its state, or keys under the coordinator's prefix."""
    if not coordinator:
        try:
            coordinator = ((state.read_json(layout.JOB) or {}).get("job") or {}).get("coordinator")
        except CorruptStateError:
            coordinator = None
    if not coordinator:
        return FileRecords(state.stage(stage) if stage else state)
    from elastic_oneshot.durability.etcd_records import EtcdRecords  # grpc: loaded by the jobs that use etcd only

    if stage:
        parts = urllib.parse.urlsplit(coordinator)
        coordinator = urllib.parse.urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{stage}"))
    return EtcdRecords.from_url(coordinator)
