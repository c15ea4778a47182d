"""``cascade serve --backend ray``: the same FastAPI app, deployed with Ray Serve.

    Ray Serve proxy (HTTP, --host/--port) ──▶ replica 1 … replica N   (serve.replicas)
                                                │ the app of cascade.serve.app, its own Server:
                                                │ one engine loop, one Batch
                                                ▼
                                  level actors in the replica's own placement group
                                  (backend ray, created by RayBackend when the replica starts)

Each replica is a plain :class:`CascadeReplica` (no Ray in it) wrapped at deployment time with
``serve.deployment`` and ``serve.ingress``; the app is built after the replica's constructor
(Ray Serve's late-bound ingress, ``__serve_build_asgi_app__``) so that it holds that replica's
:class:`~cascade.serve.server.Server`. Ray Serve sends each replica at most
``serve.max_ongoing_requests`` requests at once; the server's own admission control
(``--max-num-seqs``, ``--max-queued``) applies inside each replica. ``/metrics`` and
``/health`` answer for the replica the request reached.
"""
from __future__ import annotations

import logging
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cascade.serve.limits import PolicyLimits

log = logging.getLogger(__name__)

APP_NAME = "cascade"


@dataclass(frozen=True)
class ReplicaOptions:
    """What a replica needs to build its cascade and server (pickled to every replica)."""

    topology: str  # absolute: replicas run in other processes, possibly on other nodes
    policy: str | None = None
    device: str | None = None
    model_name: str | None = None
    max_num_seqs: int = 16
    max_queued: int = 64
    chat_template: str | None = None  # the template's text
    allow_policies: tuple[str, ...] = ()  # module:Class policies requests may name (--allow-policy)
    max_body_bytes: int | None = None  # larger request bodies get 413 (None: the app's default)
    policy_limits: PolicyLimits | None = None  # what a request's policy may ask (None: the defaults)


class CascadeReplica:
    """One replica: a cascade whose levels are Ray actors (``backend="ray"``; inside a replica
    Ray is already connected, so the backend joins that cluster) and a server stepping it."""

    def __init__(self, options: ReplicaOptions):
        from cascade.api import Cascade
        from cascade.serve.server import Server

        self.options = options
        cascade = Cascade.from_topology(options.topology, backend="ray", policy=options.policy,
                                        device=options.device)
        try:
            self.server = Server(cascade, model_name=options.model_name, max_num_seqs=options.max_num_seqs,
                                 max_queued=options.max_queued, chat_template=options.chat_template,
                                 allow_policies=options.allow_policies, policy_limits=options.policy_limits)
        except BaseException:
            cascade.close()
            raise
        self.server.start()

    def __serve_build_asgi_app__(self):
        from cascade.serve.app import build_app

        limit = self.options.max_body_bytes
        return build_app(self.server) if limit is None else build_app(self.server, max_body_bytes=limit)

    def __del__(self):  # Ray Serve stops a replica by deleting it: free its actors and group
        server = getattr(self, "server", None)
        if server is not None:
            server.close()


def application(options: ReplicaOptions, replicas: int, max_ongoing_requests: int, num_cpus: float = 1.0):
    """The Ray Serve application: :class:`CascadeReplica` as an ingress deployment."""
    from ray import serve

    ingress = serve.ingress()(CascadeReplica)  # late-bound: the app comes from the replica
    deployment = serve.deployment(ingress, name="CascadeReplica", num_replicas=replicas,
                                  max_ongoing_requests=max_ongoing_requests,
                                  ray_actor_options={"num_cpus": num_cpus})
    return deployment.bind(options)


def serve_on_ray(args, chat_template: str | None) -> int:
    """Deploy on the cluster (``--address``, else the topology's ``ray.address``: an existing
    cluster when RAY_ADDRESS is set, otherwise a private runtime on this machine sized for the
    replicas and their levels), wait until every replica has started, serve until SIGINT or
    SIGTERM, then delete the application (and stop a private runtime).

    What the cluster cannot hold is an error before anything is deployed (the placement
    check); a replica that fails to start, or does not start in time, is an error too. Either
    way the application is deleted, so no replica, actor or placement group is left behind.
    """
    import ray
    from ray import serve

    from cascade.backends.ray import private_cpus
    from cascade.backends.ray_runtime import connect, drop_private_token, resolve_address
    from cascade.topology import load_topology

    topo = load_topology(args.topology)  # a bad file fails here, before anything is deployed
    spec = topo.spec.serve
    options = ReplicaOptions(str(Path(args.topology).resolve()), args.policy or None, args.device,
                             args.served_model_name or topo.spec.name, args.max_num_seqs, args.max_queued,
                             chat_template, allow_policies=tuple(args.allow_policy),
                             max_body_bytes=args.max_body_bytes, policy_limits=args.policy_limits)
    address, source = ((args.address, "--address") if args.address
                       else (topo.spec.ray.address, f"{topo.source}: ray.address"))
    private = resolve_address(address, source)[0] == "local"
    owns, private_token = connect(address, topo.spec.ray.namespace,
                                  private_cpus(topo, spec.replicas, spec.num_cpus), source)
    stop = _Stop()
    deployed = False
    try:
        check_capacity(topo, spec.replicas, spec.num_cpus)
        serve.start(http_options={"host": args.host, "port": args.port})
        deployed = True
        print(f"cascade serve: starting {spec.replicas} replica(s) on Ray Serve", flush=True)
        ray_spec = topo.spec.ray
        _deploy(application(options, spec.replicas, spec.max_ongoing_requests, spec.num_cpus), stop,
                ray_spec.placement_timeout_s + ray_spec.start_timeout_s + 60)
        if not stop.requested:
            print(f"cascade serve: {spec.replicas} replica(s) on Ray Serve at http://{args.host}:{args.port}/v1",
                  flush=True)
        while not stop.requested:
            time.sleep(0.5)
    finally:
        if deployed:
            try:
                serve.delete(APP_NAME)
            except Exception:  # noqa: BLE001 - the cluster may be gone already
                log.warning("could not delete the Ray Serve application %r", APP_NAME)
        if owns:
            if private and deployed and ray.is_initialized():
                serve.shutdown()  # a private runtime: nothing else uses its Serve instance
            ray.shutdown()
        if private_token:
            drop_private_token()
    return 0


def check_capacity(topo, replicas: int, replica_cpus: float) -> None:
    """Fail before deploying when the cluster cannot hold ``replicas`` replicas: reserve what
    they will ask for (each replica's own CPUs, and per replica a placement group of one bundle
    per level actor), wait up to ``ray.placement_timeout_s``, then give it all back.

    Why here: a replica whose group is never placed only fails inside Ray Serve, which retries
    it, and a replica that is never scheduled does not fail at all (the controller logs a
    warning every 30 s); the driver would print its address and never answer.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from cascade.backends.ray import level_bundles, unplaceable
    from cascade.errors import TopologyError

    spec = topo.spec.ray
    bundles = level_bundles(topo)
    own = [{"CPU": float(replica_cpus)}] if replica_cpus > 0 else []
    groups = [placement_group(bundles, strategy=spec.placement_strategy) for _ in range(replicas) if bundles]
    if own:
        groups.append(placement_group(own * replicas, strategy="PACK"))
    try:
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=spec.placement_timeout_s)
    finally:
        for g in groups:
            remove_placement_group(g)
    if len(ready) < len(groups):
        raise TopologyError(f"{topo.source}: serve.replicas, levels[*].resources: for each of {replicas} "
                            f"replica(s) (its own CPUs first, then its levels) "
                            + unplaceable(own + bundles, spec.placement_strategy, spec.placement_timeout_s))


def _deploy(app, stop: "_Stop", timeout_s: float) -> None:
    """Deploy ``app`` and wait until it runs. A replica that failed to start, or no running
    application within ``timeout_s``, is a :class:`~cascade.errors.ClusterError` with the
    reason Ray Serve gives.

    ``serve.run`` itself waits with no limit (a replica that is never scheduled holds it forever,
    and SIGINT only sets ``stop`` here), and it goes on while Serve retries a failing replica:
    it runs in a thread of its own while this one watches the application's status.
    """
    from ray import serve

    from cascade.errors import ClusterError

    failure: list[BaseException] = []

    def run() -> None:
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except BaseException as exc:  # noqa: BLE001 - reported by the watching thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="serve.run", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not stop.requested:
        app_status = serve.status().applications.get(APP_NAME)
        status = str(getattr(app_status, "status", ""))
        if status.endswith("RUNNING") and not thread.is_alive() and not failure:
            return
        messages = [d.message for d in getattr(app_status, "deployments", {}).values() if d.message]
        failed = [m for m in messages if "failed to start" in m]
        if failed or failure or status.endswith(("DEPLOY_FAILED", "UNHEALTHY")):
            reason = _reason(failed or messages or [str(failure[0]) if failure else status])
            raise ClusterError(f"cascade serve: a replica failed to start: {reason}")
        if time.monotonic() > deadline:
            raise ClusterError(f"cascade serve: the replicas did not start within {timeout_s:g} s "
                               "(ray.placement_timeout_s + ray.start_timeout_s + 60 s): "
                               f"{_reason(messages or [status])}")
        time.sleep(0.5)


def _reason(messages: list[str]) -> str:
    """The exception's own line out of Ray Serve's message (a traceback follows its 'Error:')."""
    text = messages[-1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    return raised[-1] if raised else " ".join(lines)[-2000:]


class _Stop:
    """SIGINT and SIGTERM end the serving loop (so that the application is deleted)."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._request)

    def _request(self, signum, frame) -> None:
        self.requested = True
