"""Joining a Ray cluster, or starting a private runtime on this machine, for the Ray backend and
``cascade serve --backend ray``.

Where the address comes from, in Ray's own order: the argument (or the topology's
``ray.address``), then RAY_ADDRESS, then for ``auto`` the ``ray_current_cluster`` file the last
``ray start`` wrote. That file outlives a head killed without ``ray stop``, so a cluster to join
is probed first: one that does not answer is a :class:`~cascade.errors.ClusterError` within
seconds, naming the address, its source and what to do, where Ray would retry for minutes. With
no address at all cascade starts its private runtime and never reads the file.
"""
from __future__ import annotations

import os
import re
import secrets
import socket
from pathlib import Path
from typing import Any

from cascade.errors import ClusterError


def connect(address: str | None, namespace: str | None, local_cpus: int,
            source: str = "the address argument") -> tuple[bool, bool]:
    """Make sure this process is connected to Ray. Returns (cascade started or joined the runtime
    and must disconnect on close, this process set a private auth token that close must drop).

    ``address`` is auto, local, host:port or ray://host:port, named by ``source`` (for errors);
    None: RAY_ADDRESS if set, else a private runtime (a ``ray_current_cluster`` file that a
    ``ray start`` left behind never decides it). A cluster to join that does not answer is a
    :class:`ClusterError` naming the address, where it came from and what to do, within seconds
    (Ray itself would retry for minutes). A process already connected (the caller's own
    ``ray.init``) is used as it is.
    """
    import ray

    if ray.is_initialized():
        return False, False
    target, where = resolve_address(address, source)
    kwargs: dict[str, Any] = {"namespace": namespace, "log_to_driver": True}
    if target == "local":
        private_token = set_private_token()
        # A private runtime on this machine, reachable on loopback only. Its actors are the
        # work itself, not background tasks: Ray's default (workers niced by 15) would let any
        # other process on the machine starve the models while the driver waits on them.
        try:
            ray.init(address="local", num_cpus=local_cpus, include_dashboard=False,
                     _node_ip_address="127.0.0.1", _system_config={"worker_niceness": 0}, **kwargs)
        except BaseException:
            if private_token:
                drop_private_token()
            raise
        return True, private_token
    _check_reachable(target, where)
    try:
        # "auto" (not the address it resolved to): Ray decides token authentication by it
        ray.init(address=address or "auto", **kwargs)
    except ConnectionError as exc:
        raise ClusterError(f"cannot connect to Ray at {target} (from {where}): {exc} {_advice(where)}") from None
    # Connected to a cluster someone else runs: disconnect on close, never shut it down. A
    # disconnect is all ray.shutdown() does for a driver that joined an existing cluster.
    return True, False


def resolve_address(address: str | None, source: str) -> tuple[str, str]:
    """The cluster ``ray.init`` would join for ``address`` and where that came from, as Ray finds
    it: RAY_ADDRESS, then for "auto" the file the last ``ray start`` wrote. ("local", "") when
    cascade starts a private runtime."""
    env = os.environ.get("RAY_ADDRESS")
    if address is None:
        return (env, "the RAY_ADDRESS variable") if env else ("local", "")
    if address != "auto":
        return address, source
    if env:
        return env, f"the RAY_ADDRESS variable, as {source} is auto"
    file = _address_file()
    found = file.read_text().strip() if file is not None and file.is_file() else ""
    if found:
        return found, f"the file {file}, written by the last `ray start`, as {source} is auto"
    return "auto", source  # Ray looks for a running cluster on this machine


def _address_file() -> Path | None:
    try:
        from ray._common.utils import get_ray_address_file
    except ImportError:  # another Ray version
        return None
    return Path(get_ray_address_file(None))


PROBE_TIMEOUT_S = 5.0  # a cluster's GCS that does not accept a connection within this is down


def _check_reachable(target: str, where: str) -> None:
    """Fail fast when nothing listens at ``target`` (host:port or ray://host:port)."""
    m = re.fullmatch(r"(?:ray://)?\[?([^\]]*?)\]?:(\d+)", target)
    if m is None:
        return  # "auto" still to be found, or a form Ray judges itself
    try:
        with socket.create_connection((m.group(1), int(m.group(2))), timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ClusterError(f"no Ray cluster answers at {target} (from {where}): {reason}. {_advice(where)}") from None


def _advice(where: str) -> str:
    if "RAY_ADDRESS" in where:
        return ("Start that cluster, point RAY_ADDRESS at a running one, or unset it for a private "
                "runtime on this machine.")
    if "ray start" in where:
        return ("The cluster that `ray start` started is gone but its file remains: `ray stop` removes "
                "it, `ray start --head` starts a new cluster, and address local (or no address) "
                "starts a private runtime on this machine.")
    return ("Start the cluster (`ray start --head`) or correct the address; address local (or no "
            "address) starts a private runtime on this machine.")


def set_private_token() -> bool:
    """Give a private runtime an auth token that lives in this process's environment only; True
    when it set one.

    Why: Ray 2.60 turns token authentication on for every runtime ``ray.init`` starts and, when
    no token exists, writes one to ``~/.ray/auth_token``. That file outlives the runtime and
    changes the machine: a later ``ray start --head`` finds it and requires the token, which
    ``ray job submit`` (RAY_AUTH_MODE unset) does not send, so the README's cluster steps fail
    with an AuthenticationError. The runtime's own processes inherit the variable, so it keeps
    token authentication all the same. A token the user has (the variables or the file Ray
    reads) or ``RAY_AUTH_MODE=disabled`` is left to Ray.
    """
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return False
    if (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
            or (Path.home() / ".ray" / "auth_token").exists()):
        return False
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # 256 bits, as Ray's own tokens
    _reset_token_cache()
    return True


def drop_private_token() -> None:
    os.environ.pop("RAY_AUTH_TOKEN", None)
    _reset_token_cache()  # the next private runtime gets a token of its own


def _reset_token_cache() -> None:
    # Ray's token loader caches the first token it read; without a reset a second private
    # runtime in this process would be sent the first one's token.
    try:
        from ray._raylet import AuthenticationTokenLoader

        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):  # another Ray version: nothing cached this way
        pass
