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
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

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
                                 allow_policies=options.allow_policies)
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
    cluster when RAY_ADDRESS is set, otherwise a private runtime on this machine), serve until
    SIGINT or SIGTERM, then delete the application (and stop a private runtime)."""
    import ray
    from ray import serve

    from cascade.backends.ray import _connect, _drop_private_token
    from cascade.topology import load_topology

    topo = load_topology(args.topology)  # a bad file fails here, before anything is deployed
    spec = topo.spec.serve
    options = ReplicaOptions(str(Path(args.topology).resolve()), args.policy or None, args.device,
                             args.served_model_name or topo.spec.name, args.max_num_seqs, args.max_queued,
                             chat_template, allow_policies=tuple(args.allow_policy),
                             max_body_bytes=args.max_body_bytes)
    address = args.address or topo.spec.ray.address or ("auto" if os.environ.get("RAY_ADDRESS") else "local")
    owns, private_token = _connect(address, topo.spec.ray.namespace, os.cpu_count() or 1)
    stop = _Stop()
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(application(options, spec.replicas, spec.max_ongoing_requests, spec.num_cpus), name=APP_NAME,
                  route_prefix="/", blocking=False)
        print(f"cascade serve: {spec.replicas} replica(s) on Ray Serve at http://{args.host}:{args.port}/v1",
              flush=True)
        while not stop.requested:
            time.sleep(0.5)
    finally:
        try:
            serve.delete(APP_NAME)
        except Exception:  # noqa: BLE001 - the cluster may be gone already
            log.warning("could not delete the Ray Serve application %r", APP_NAME)
        if owns:
            if address == "local" and ray.is_initialized():
                serve.shutdown()  # a private runtime: nothing else uses its Serve instance
            ray.shutdown()
        if private_token:
            _drop_private_token()
    return 0


class _Stop:
    """SIGINT and SIGTERM end the serving loop (so that the application is deleted)."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._request)

    def _request(self, signum, frame) -> None:
        self.requested = True
