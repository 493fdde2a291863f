"""A throwaway S3-compatible server for tests and benchmarks: moto in server mode on 127.0.0.1, in a temporary
directory, with one bucket, stopped by its PID. With `auth`, it checks every request's signature as AWS does, against
an access key it issued at start (in `env`); its log (`log.name`) holds every request's Authorization header, so that
a test can tell which credentials the product used. With `namespace` (netns.py), it runs inside that network
namespace, reached over its shaped link.

    with S3Server() as s3:
        os.environ.update(s3.env)        # what a user sets to point the product at it
        state = f"s3://{s3.bucket}/job"
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from urllib.parse import quote, unquote_plus, urlsplit

from elastic_oneshot.testing.netns import Namespace

UNSIGNED = 5  # requests moto serves before it checks signatures: the bucket and _issue_key's four


class S3Server:
    def __init__(self, bucket: str = "elastic-oneshot", auth: bool = False, namespace: Namespace | None = None):
        self.bucket, self.auth, self.proc, self.namespace = bucket, auth, None, namespace
        if namespace is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]
        else:
            self.port = 9000  # the namespace's own: nothing else listens there
        self.address = "127.0.0.1" if namespace is None else namespace.address
        self.endpoint = f"http://{self.address}:{self.port}"
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                    "AWS_ENDPOINT_URL": self.endpoint, "AWS_ALLOW_HTTP": "true"}

    def start(self) -> "S3Server":
        self.dir = tempfile.mkdtemp(prefix="moto-")
        self.log = open(os.path.join(self.dir, "moto.log"), "w")
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(UNSIGNED)} if self.auth else None
        cmd = [sys.executable, "-m", "elastic_oneshot.testing.s3_server", "-H", self.address, "-p", str(self.port)]
        popen = subprocess.Popen if self.namespace is None else self.namespace.popen
        self.proc = popen(cmd, cwd=self.dir, stdout=self.log, stderr=self.log, env=env)
        for _ in range(100):  # up, with its bucket
            try:
                urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/{self.bucket}", method="PUT"),
                                       timeout=1)
                if self.auth:
                    self._issue_key()
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto did not start on port {self.port}; see {self.log.name}")

    def _issue_key(self):
        """A user allowed everything on S3, and its access key."""
        import boto3

        iam = boto3.client("iam", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="x",
                           aws_secret_access_key="x")
        iam.create_user(UserName="job")
        policy = json.dumps({"Version": "2012-10-17",
                             "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]})
        arn = iam.create_policy(PolicyName="s3", PolicyDocument=policy)["Policy"]["Arn"]
        iam.attach_user_policy(UserName="job", PolicyArn=arn)
        key = iam.create_access_key(UserName="job")["AccessKey"]
        self.env.update(AWS_ACCESS_KEY_ID=key["AccessKeyId"], AWS_SECRET_ACCESS_KEY=key["SecretAccessKey"])

    def stop(self):
        """SIGTERM, then SIGKILL after 10 s: the server's threads wait for keep-alive connections that a client
        still open in the test's own process may hold."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def serve(argv: list[str]):
    """moto's server (its command line), with two hooks: every request's method, path and Authorization header
    logged to stderr (never a secret: SigV4 sends a signature); and signatures checked against the query as AWS
    canonicalizes it (each name and value decoded, `+` as a space, and encoded again leaving only unreserved
    characters). moto checks them against the query as the URL holds it, so it refuses a client that encodes
    otherwise (getmoto/moto#5948): every signed LIST under a prefix in moto 5.2.1; in 5.2.5 obstore's LIST under a
    prefix holding a space or a tilde."""
    import moto.server
    from moto.iam.access_control import IAMRequestBase

    create = IAMRequestBase._create_aws_request

    def canonical(self):
        request = create(self)
        url = urlsplit(request.url)
        pairs = sorted(tuple(quote(unquote_plus(part), safe="-_.~") for part in pair.partition("=")[::2])
                       for pair in url.query.split("&") if pair)
        request.url = url._replace(query="&".join(f"{k}={v}" for k, v in pairs)).geturl()
        return request

    IAMRequestBase._create_aws_request = canonical
    run = moto.server.run_simple

    def logged(app):
        def call(environ, start_response):
            os.write(2, f"{environ['REQUEST_METHOD']} {environ.get('RAW_URI', environ['PATH_INFO'])} Authorization: "
                        f"{environ.get('HTTP_AUTHORIZATION', '-')}\n".encode())  # one write: threads log at once
            return app(environ, start_response)
        return call

    moto.server.run_simple = lambda host, port, app, **kw: run(host, port, logged(app), **kw)
    moto.server.main(argv)


if __name__ == "__main__":
    serve(sys.argv[1:])
