"""``cascade serve``: the OpenAI-compatible server, embedded (FastAPI + uvicorn, one process)."""
from __future__ import annotations

import sys
from pathlib import Path

from cascade.cli import args as types
from cascade.cli.args import MAIN_TOPOLOGY_HELP, guarded, topology_file
from cascade.serve.protocol import MAX_BODY_BYTES
from policies import REGISTRY


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the topology over an OpenAI-compatible HTTP API",
                       description="Serve POST /v1/completions, POST /v1/chat/completions, GET /v1/models, "
                                   "GET /health and GET /metrics with one continuously batched cascade.")
    p.add_argument("--topology", "-t", default=None, help=MAIN_TOPOLOGY_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=types._integer(1, 65536), default=8000, help="port (default 8000)")
    p.add_argument("--max-num-seqs", type=types.positive_int, default=16,
                   help="most requests in the batch at once (default 16)")
    p.add_argument("--max-queued", type=types.nonnegative_int, default=64,
                   help="most requests waiting for a place; more are refused with 429 (default 64)")
    p.add_argument("--chat-template", type=types.nonempty, default=None, metavar="FILE",
                   help="a Jinja chat template (default: the authority tokenizer's)")
    p.add_argument("--policy", type=types.policy_spec, default=None,
                   help="NAME[:key=value,...], e.g. fixed:lookahead=4 (default: the topology's)")
    p.add_argument("--device", type=types.device, default=None,
                   help="override every level's device (cpu, cuda:0, auto)")
    p.add_argument("--served-model-name", type=types.nonempty, default=None,
                   help="the model id clients name (default: the topology's name)")
    p.add_argument("--max-body-bytes", type=types.positive_int, default=MAX_BODY_BYTES, metavar="N",
                   help="larger request bodies are refused with 413 before they are read "
                        f"(default {MAX_BODY_BYTES} = {MAX_BODY_BYTES >> 20} MiB)")
    p.add_argument("--allow-policy", type=_policy_class, action="append", default=[], metavar="MODULE:CLASS",
                   help="let requests name this policy class in their policy field (repeatable); requests "
                        f"may name the registered policies ({', '.join(sorted(REGISTRY))}) and these only")
    p.add_argument("--policy-limit", type=_policy_limit, action="append", default=[], metavar="KEY=N",
                   help="the most a request's own policy may ask, beyond which it is refused with 400 "
                        "(repeatable): lookahead (default 32), tree_nodes (64), tree_depth (16), tree_width (8)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--backend", choices=["embedded", "ray"], default="embedded",
                   help="ray: deploy the same app on Ray Serve, the topology's serve: section giving "
                        "replicas, each replica's levels Ray actors (default: embedded, one process)")
    p.add_argument("--address", default=None,
                   help="with --backend ray: the Ray cluster: auto, local or host:port (default: the "
                        "topology's ray.address; unset: RAY_ADDRESS if set, else a private runtime sized "
                        "for the replicas and their levels)")
    p.set_defaults(func=serve)


def _policy_class(text: str) -> str:
    """A ``module:Class`` policy path, imported and checked now (the operator's, so trusted)."""
    import argparse

    from policies import PolicyError, resolve

    if ":" not in text or text in REGISTRY:
        raise argparse.ArgumentTypeError(f"expected a module:Class path (the registered policies are allowed "
                                         f"already), got {text!r}")
    try:
        resolve(text)
    except PolicyError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (got {text!r})") from None
    return text


def _policy_limit(text: str) -> str:
    """One ``KEY=N`` of --policy-limit, checked now."""
    import argparse

    from cascade.errors import RequestError
    from cascade.serve.limits import PolicyLimits

    try:
        PolicyLimits.parse([text])
    except RequestError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("policy-limit").lstrip(".: ")) from None
    return text


@guarded
def serve(args) -> int:
    import uvicorn

    from cascade.api import Cascade
    from cascade.errors import RequestError
    from cascade.serve.app import build_app
    from cascade.serve.limits import PolicyLimits
    from cascade.serve.server import Server

    args.topology = topology_file(args.topology, lambda line: print(line, file=sys.stderr))
    args.policy_limits = PolicyLimits.parse(args.policy_limit)
    template = None
    if args.chat_template:
        try:
            template = Path(args.chat_template).read_text()
        except OSError as exc:
            raise RequestError(f"chat-template: cannot read {args.chat_template}: {exc}") from None
    if args.backend == "ray":
        from cascade.serve.ray_serve import serve_on_ray

        return serve_on_ray(args, template)
    cascade = Cascade.from_topology(args.topology, policy=args.policy or None, device=args.device)
    try:
        server = Server(cascade, model_name=args.served_model_name, max_num_seqs=args.max_num_seqs,
                        max_queued=args.max_queued, chat_template=template, allow_policies=args.allow_policy,
                        policy_limits=args.policy_limits)
    except BaseException:
        cascade.close()
        raise
    try:
        server.start()
        # streams still open at shutdown get a few seconds to end, then the server closes them
        uvicorn.run(build_app(server, max_body_bytes=args.max_body_bytes), host=args.host, port=args.port,
                    log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        server.close()
    return 0
