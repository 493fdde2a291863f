"""The byte forms of the JSON this tool writes, each in one place: a form is part of a format (docs/state-format.md),
and a byte that moves changes checksums, fingerprints and the checkpoint's marker."""

import json


def canonical_json(obj) -> bytes:
    """Keys sorted, no spaces: what checksums cover, and etcd values."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def record_json(obj) -> bytes:
    """Keys sorted, indented by one: a record on disk (state.write_json's documents, a checkpoint's marker)."""
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def fingerprint_json(obj) -> bytes:
    """Keys sorted, Python's default separators: what a job's fingerprint hashes (job.json's identity)."""
    return json.dumps(obj, sort_keys=True).encode()


def event_line(event: dict) -> bytes:
    """One line of the history: keys sorted, ended by a newline."""
    return (json.dumps(event, sort_keys=True) + "\n").encode()
