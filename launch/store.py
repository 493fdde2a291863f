"""A standalone rendezvous store for c10d: run it on a stable host, point every agent at it with
`--rdzv-endpoint=HOST:PORT --rdzv-conf=is_host=false,...`. The job then survives the loss of any
worker node, including the one that was rank 0 (with c10d's default the store lives inside one agent,
and losing that node ends the job).

    python launch/store.py --port 29400
"""

import argparse
import datetime
import signal

from torch.distributed import TCPStore


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=29400)
    a = p.parse_args()
    store = TCPStore(a.host, a.port, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(days=365))
    print(f"rendezvous store serving on {a.host}:{store.port}", flush=True)
    signal.sigwait({signal.SIGINT, signal.SIGTERM})


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    main()
