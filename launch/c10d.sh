#!/usr/bin/env bash
# Several nodes with c10d rendezvous. Run this on every node, with the same STORE and JOB_ID.
# STORE is a host:port serving the rendezvous store: a standalone one (launch/store.py on a stable
# host: survives losing any node) or, with IS_HOST=1 on exactly one node, that node's agent (simpler;
# losing that node ends the job).
#   STORE=head:29400 JOB_ID=qwen3 MIN=1 MAX=4 launch/c10d.sh --model /models/x --state /shared/x.state --output /shared/x-w4a16
set -euo pipefail
: "${STORE:?set STORE=host:port}" "${JOB_ID:?set JOB_ID, the same on every node}" "${MIN:=1}" "${MAX:=4}"
source "$(dirname "$0")/env.sh"
if [ "${IS_HOST:-0}" = 1 ]; then host_conf="is_host=true"; else host_conf="is_host=false"; fi
exec torchrun --nnodes="$MIN:$MAX" --nproc-per-node="$NPROC" --max-restarts="$MAX_RESTARTS" \
    --rdzv-backend=c10d --rdzv-endpoint="$STORE" --rdzv-id="$JOB_ID" --rdzv-conf="$host_conf,$RDZV_CONF" \
    -m elastic_oneshot run --collective-timeout "$ELASTIC_ONESHOT_COLLECTIVE_TIMEOUT" "$@"
