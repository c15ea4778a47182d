"""Stopping what a test started: a server, a Ray head held by ``ray start --block``."""
from __future__ import annotations

import subprocess


def stop(proc: subprocess.Popen, timeout: float = 90) -> None:
    """SIGTERM (a Ray head started with --block then stops exactly its own cluster; a server shuts
    down gracefully), and SIGKILL if it has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)
