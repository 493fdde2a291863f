"""The records interface (elastic_oneshot/records.py): both backends declare it whole, and open_records picks the
one a state directory names. No etcd server is needed: EtcdRecords connects on first use."""
import inspect

import pytest

from elastic_oneshot.durability.coordinator import open_records
from elastic_oneshot.durability.etcd_records import EtcdRecords
from elastic_oneshot.durability.records import FileRecords, Records
from elastic_oneshot.durability.state import StateStore


@pytest.mark.parametrize("backend", [FileRecords, EtcdRecords])
def test_each_backend_implements_every_method_with_its_signature(backend):
    assert issubclass(backend, Records) and not backend.__abstractmethods__
    for name, declared in inspect.getmembers(Records, inspect.isfunction):
        if not name.startswith("_"):
            own = inspect.signature(getattr(backend, name))
            assert list(own.parameters) == list(inspect.signature(declared).parameters), f"{backend.__name__}.{name}"


def test_open_records_follows_the_coordinator_given_or_recorded(tmp_path):
    state = StateStore(tmp_path / "state")
    files = open_records(state)
    assert isinstance(files, FileRecords) and files.url is None
    assert files.fence(1) is None and files.committed() == {} and files.current_epoch() == 0
    files.claim({"fingerprint": "f"}, state.root)  # the defaults: nothing to do for files
    files.adopt({"fingerprint": "f"}, state.root)
    files.attach(0, 1, 2)
    files.detach()
    assert list(files.watch_progress(timeout=0)) == [None]
    assert files.begin_epoch({}) == 1 and {k: v for k, v in files.fence(1).items() if k != "nonce"} == \
        {"epoch": 1, "committed": {}}

    given = open_records(state, "etcd://127.0.0.1:2/jobs/a?user=u&password=secret")
    assert isinstance(given, EtcdRecords) and given.url == "etcd://127.0.0.1:2/jobs/a?user=u"
    state.write_json("job.json", {"job": {"coordinator": given.url}})
    recorded = open_records(state)
    assert isinstance(recorded, EtcdRecords) and recorded.url == given.url
