"""Which records a state's job keeps: files in the state directory, or an etcd coordinator (`--coordinator`)."""

from elastic_oneshot.durability import layout
from elastic_oneshot.durability.records import FileRecords, Records
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.errors import CorruptStateError


def open_records(state: StateStore, coordinator: str | None = None) -> Records:
    """The records of the job in `state`: in etcd at `coordinator` if given, else at the coordinator job.json
    records (so that export, status and a resume find them there), else files in the state directory."""
    if not coordinator:
        try:
            coordinator = ((state.read_json(layout.JOB) or {}).get("job") or {}).get("coordinator")
        except CorruptStateError:
            coordinator = None
    if not coordinator:
        return FileRecords(state)
    from elastic_oneshot.durability.etcd_records import EtcdRecords  # grpc: loaded by the jobs that use etcd only

    return EtcdRecords.from_url(coordinator)
