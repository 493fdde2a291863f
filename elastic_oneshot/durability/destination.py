"""Where the checkpoint goes: a local directory (export.py), or an object-store prefix (`s3://`, `gs://`, `az://`,
`file://` URLs), where it is written to a local temporary directory ($TMPDIR) by the same export, then uploaded.

An object store has no rename, so the upload keeps the local rules another way. The marker (elastic-oneshot.json)
goes up last: a reader sees the checkpoint complete only with it. Before anything else, a pending marker
(elastic-oneshot.pending.json) goes up, naming this job and every file of the prefix it may leave behind, so that
an interrupted upload is known as this job's and finished by the next export. A prefix holding anything that no
marker of this job lists is refused, and nothing is deleted that a marker of this job does not list.
"""

import json
import os
import shutil
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor

from elastic_oneshot.durability.records import Records
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.durability.storage import ObjectStorage, is_url
from elastic_oneshot.errors import UsageError
from elastic_oneshot.models.source import SourceModel
from elastic_oneshot.surface.export import MARKER, check_output, claim_output, export

PENDING = "elastic-oneshot.pending.json"


def check_destination(output: str, fingerprint: str, state_root: str):
    """Refuse, before any work, an --output this job may not write (check_output's rules), or (a prefix) cannot;
    a local one's writability is preflight's."""
    if not is_url(output):
        check_output(output.rstrip("/"), fingerprint)
        return
    out, state = output.rstrip("/"), state_root.rstrip("/")
    if state == out or state.startswith(out + "/") or out.startswith(state + "/"):
        raise UsageError(f"--output {out} and --state {state} overlap: give each its own prefix")
    storage = ObjectStorage(out)
    _ours(storage, fingerprint)
    probe = f".elastic-oneshot-probe-{uuid.uuid4().hex}"
    storage.put(probe, b"")
    storage.remove(probe)


def claim_destination(output: str, fingerprint: str):
    """Rank 0, once the state is this job's: a local --output is claimed for it (export.claim_output); an
    object prefix is checked at the export, whose marker goes last."""
    if not is_url(output):
        claim_output(output.rstrip("/"), fingerprint)


def export_to(state: StateStore, records: Records, output: str, source: SourceModel | None = None,
              schemes: dict | None = None) -> str:
    """export() to `output`, a local directory or an object-store prefix; returns `output`."""
    if not is_url(output):
        return export(state, records, output, source, schemes)
    fingerprint = state.job()["fingerprint"]
    check_destination(output, fingerprint, state.root)
    scratch = tempfile.mkdtemp(prefix="elastic-oneshot-export-")
    try:
        local = os.path.join(scratch, "checkpoint")
        export(state, records, local, source, schemes)
        _upload(ObjectStorage(output.rstrip("/")), local, fingerprint)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return output


def _ours(storage: ObjectStorage, fingerprint: str) -> set[str]:
    """The names under `storage` that this job's markers list; UsageError if it holds anything else."""
    names = set(storage.names(""))
    listed, foreign = set(), []
    for marker in (MARKER, PENDING):
        if marker in names:
            record = _json(storage.get(marker))
            if record.get("fingerprint") == fingerprint:
                listed |= {marker, *record.get("files", [])}
            else:
                foreign.append(marker)
    if names and (foreign or not listed):
        raise UsageError(f"--output {storage.root} exists and is not this job's checkpoint: give a new --output, "
                         "or move it away")
    extra = sorted(names - listed)
    if extra:
        raise UsageError(f"--output {storage.root} holds files this tool did not write ({', '.join(extra[:3])}): "
                         "move them away")
    return listed


def _json(data: bytes | None) -> dict:
    try:
        record = json.loads(data or b"")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _upload(storage: ObjectStorage, local: str, fingerprint: str):
    """The checkpoint at `local` to `storage`: the pending marker, then the files in parallel, then what this job
    wrote before and no longer writes is deleted, then the marker, last; the pending marker goes after it."""
    before = _ours(storage, fingerprint)  # again: the export took a while, and the prefix is the user's meanwhile
    files = sorted(set(os.listdir(local)) - {MARKER})
    pending = {"files": sorted(before | set(files)), "fingerprint": fingerprint, "written_by": "elastic-oneshot"}
    storage.put(PENDING, json.dumps(pending, indent=1, sort_keys=True).encode())
    storage.remove(MARKER)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda name: storage.upload(name, os.path.join(local, name)), files))
    for name in sorted(before - set(files) - {MARKER, PENDING}):
        storage.remove(name)
    storage.upload(MARKER, os.path.join(local, MARKER))
    storage.remove(PENDING)
