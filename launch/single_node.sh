#!/usr/bin/env bash
# One machine, one worker per GPU (one in all on CPU): when the model fits the time budget of one node. No
# rendezvous service (--standalone). A worker that dies is restarted with the others (up to MAX_RESTARTS) and
# the job resumes from its last committed layer; after anything worse, run the same command again.
#   launch/single_node.sh --model /models/x --state /data/x.state --output /data/x-w4a16 [run options]
set -euo pipefail
source "$(dirname "$0")/env.sh"
exec torchrun --standalone --nproc-per-node="$NPROC" --max-restarts="$MAX_RESTARTS" \
    -m elastic_oneshot run --collective-timeout "$ELASTIC_ONESHOT_COLLECTIVE_TIMEOUT" "$@"
