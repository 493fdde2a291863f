# Settings every launcher here sources: what makes torchrun 2.13 elastic in practice.
# - TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it a node joining a running job crashes the agents, and
#   restarted workers can read the previous round's addresses from the reused store.
# - last_call_timeout=2: a rendezvous waits this long for more nodes once MIN are in (default 30 s).
# - keep_alive_interval=1,keep_alive_max_attempt=3: a lost node is noticed within about 3 s.
# - ELASTIC_ONESHOT_COLLECTIVE_TIMEOUT: a frozen peer is given up on after this many seconds.
# - OMP_NUM_THREADS: threads per worker; keep it fixed for bitwise-reproducible results.
# - NPROC: workers per node: one per GPU, else one.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
export RDZV_CONF="${RDZV_CONF:-last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=900}"
export ELASTIC_ONESHOT_COLLECTIVE_TIMEOUT="${ELASTIC_ONESHOT_COLLECTIVE_TIMEOUT:-60}"
export MAX_RESTARTS="${MAX_RESTARTS:-100}"
NPROC="${NPROC:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}"
[ "${NPROC:-0}" -gt 0 ] || NPROC=1
export NPROC
export JOB_ID="${JOB_ID:-elastic-oneshot-$(date +%Y%m%d%H%M%S)-$RANDOM}"
