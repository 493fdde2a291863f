"""A restart's first reads, begun as its worker process starts.

A restarted worker spends seconds importing (transformers, compressed-tensors) and setting up its epoch before the
layer loop reads anything; on a slow link those seconds are the link's to use. `start` guesses from the records
alone what the restart reads first (protocol.first_reads: the replayed layers' weights, then this rank's chunks of
the boundary it replays from) and reads it ahead (state.read_ahead). Only a guess: the run checks every file against
its digest when it reads it, drops what it did not use once its inputs are restored, and a state that turns out not
to be this job's costs the reads only. With the records in etcd, the reads begin with the epoch instead.
"""

import logging
import os
import threading

from elastic_oneshot.durability.coordinator import open_records
from elastic_oneshot.durability.protocol import CommitProtocol
from elastic_oneshot.durability.state import StateStore
from elastic_oneshot.loop.data import own_chunks

log = logging.getLogger("elastic_oneshot")


def start(state_dir: str | None, restart: bool = False) -> threading.Thread:
    """Begin reading ahead, as rank $RANK of $WORLD_SIZE, what a resume of the state at `state_dir` reads first
    (nothing with `restart`, which starts over); join the thread before the run opens the state, so that the
    guess is in place before the run's first read."""
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    thread = threading.Thread(target=_read_ahead, args=(None if restart else state_dir, world_size, rank),
                              name="restart-reads", daemon=True)
    thread.start()
    return thread


def _read_ahead(state_dir: str | None, world_size: int, rank: int):
    if not state_dir:
        return
    try:
        state = StateStore(state_dir, retry_s=1.0)
        job = state.job()
        if job["job"].get("coordinator"):
            return
        samples = job["identity"]["samples"]
        records = open_records(state)
        own = own_chunks(samples["num_samples"], samples["chunk_size"], world_size, rank)
        files = CommitProtocol(state, records, records.committed()).first_reads(own)
        if files:
            state.read_ahead(files)
            log.info("reading ahead %d files (%.1f MB) that the restart replays from", len(files),
                     sum(f["size"] for f in files) / 1e6)
    except Exception as e:  # only a guess: the run meets, and reports, whatever failed here
        log.debug("no read-ahead: %s", e)
