"""A throwaway S3-compatible server for tests and benchmarks: moto in server mode on 127.0.0.1, in a temporary
directory, with one bucket, stopped by its PID.

    with S3Server() as s3:
        os.environ.update(s3.env)        # what a user sets to point the product at it
        state = f"s3://{s3.bucket}/job"
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


class S3Server:
    def __init__(self, bucket: str = "elastic-oneshot"):
        self.bucket, self.proc = bucket, None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                    "AWS_ENDPOINT_URL": self.endpoint, "AWS_ALLOW_HTTP": "true"}

    def start(self) -> "S3Server":
        self.dir = tempfile.mkdtemp(prefix="moto-")
        self.log = open(os.path.join(self.dir, "moto.log"), "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     cwd=self.dir, stdout=self.log, stderr=self.log)
        for _ in range(100):  # up, with its bucket
            try:
                urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/{self.bucket}", method="PUT"),
                                       timeout=1)
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto did not start on port {self.port}; see {self.log.name}")

    def stop(self):
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
            self.proc = None

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc):
        self.stop()
