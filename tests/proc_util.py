"""Services a test started: stopping them (a server, a Ray head held by ``ray start --block``), and
waiting for what a test uses of them."""
from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request


def stop(proc: subprocess.Popen, timeout: float = 90) -> None:
    """SIGTERM (a Ray head started with --block then stops exactly its own cluster; a server shuts
    down gracefully), and SIGKILL if it has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def wait_for_job_agent(dashboard: str, process: subprocess.Popen, token: str | None = None,
                       timeout: float = 180) -> None:
    """Wait until a cluster's job API accepts a job, within ``timeout`` seconds.

    The dashboard answers before the head node's job agent has registered; a submission in that
    window fails with 500 "No available agent to submit job" (seen on a busy machine). So a no-op
    job is submitted until one is accepted — what the tests themselves then do. ``token``: the
    cluster's auth token, where it requires one."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    body = json.dumps({"entrypoint": "true"}).encode()
    deadline, last = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the Ray head exited ({process.returncode}) before its job agent was up")
        request = urllib.request.Request(f"{dashboard}/api/jobs/", data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30):
                return
        except urllib.error.HTTPError as e:
            last = e.read().decode(errors="replace")[:300]
            if e.code != 500:
                raise AssertionError(f"the job API refused a no-op job: {e.code} {last}") from e
        except OSError as e:  # not listening yet, or a slow answer
            last = str(e)
        time.sleep(1)
    raise AssertionError(f"no job agent on {dashboard} within {timeout:g} s (last answer: {last})")
