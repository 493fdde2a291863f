#!/usr/bin/env bash
# Several nodes that come and go, with an etcd (v3 API, any version) as the one stable service: torchrun's
# rendezvous lives in etcd through this package's `etcd3` backend, so losing any node, rank 0's included, only
# shrinks the job (c10d.sh needs a standalone store for that). Run on every node with the same ETCD and JOB_ID.
# COORDINATOR=etcd://HOST:PORT/jobs/NAME (optional) also keeps the job's epochs and commits in that etcd (see
# elastic_oneshot/durability/etcd_records.py), and `elastic-oneshot status --watch` then follows progress there.
#   ETCD=etcd-host:2379 JOB_ID=qwen3 MIN=1 MAX=4 launch/etcd3.sh --model /models/x --state /shared/x.state --output /shared/x-w4a16
set -euo pipefail
: "${ETCD:?set ETCD=host:port of etcd}" "${JOB_ID:?set JOB_ID, the same on every node}" "${MIN:=1}" "${MAX:=4}"
source "$(dirname "$0")/env.sh"
exec torchrun --nnodes="$MIN:$MAX" --nproc-per-node="$NPROC" --max-restarts="$MAX_RESTARTS" \
    --rdzv-backend=etcd3 --rdzv-endpoint="$ETCD" --rdzv-id="$JOB_ID" --rdzv-conf="$RDZV_CONF" \
    -m elastic_oneshot run --collective-timeout "$ELASTIC_ONESHOT_COLLECTIVE_TIMEOUT" \
    ${COORDINATOR:+--coordinator "$COORDINATOR"} "$@"
