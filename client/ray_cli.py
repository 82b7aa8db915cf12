"""`specmesh ray up|down|status`: a cluster YAML on Ray (`client/ray_cluster.py`; needs the
`ray` extra: pip install 'specmesh[ray]').

    specmesh ray up configs/ray.yaml                     # a local Ray cluster, in the foreground: Ctrl-C drains and stops
    specmesh ray up configs/ray.yaml --address auto      # into a running cluster (ray start --head ...); returns
    specmesh ray up configs/ray.yaml --address ray://head:10001
    specmesh ray status [--address auto] [--namespace specmesh]
    specmesh ray down   [--address auto] [--namespace specmesh] [--grace-s 30]
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def register(subparsers) -> None:
    """Add `ray` and its subcommands to the `specmesh` CLI's subparsers."""
    ray_parser = subparsers.add_parser("ray", help="run a cluster YAML on Ray (up / down / status)")
    commands = ray_parser.add_subparsers(dest="ray_command", required=True)
    connect = argparse.ArgumentParser(add_help=False)
    connect.add_argument("--namespace", default=None, help="Ray namespace of the cluster's actors (default: the YAML's, else specmesh)")
    connect.add_argument("--grace-s", type=float, default=30.0, help="drain: how long open sessions get before a replica stops")

    up = commands.add_parser("up", parents=[connect], help="place every service of CONFIG as Ray actors")
    up.add_argument("config", help="cluster YAML, with a `ray:` key per service (configs/ray.yaml)")
    up.add_argument("--address", default="", help="auto | ray://host:10001 | host:6379: a running Ray cluster "
                                                  "(the actors outlive this command); empty: start a local one and stay in the foreground")
    up.add_argument("--timeout-s", type=float, default=900.0, help="how long to wait for every replica to serve")
    up.set_defaults(handler=_up)

    down = commands.add_parser("down", parents=[connect], help="drain and stop the services placed by `ray up --address`")
    down.add_argument("--address", default="auto", help="the Ray cluster (default: auto)")
    down.set_defaults(handler=_down)

    status = commands.add_parser("status", parents=[connect], help="the registered replicas, by kind")
    status.add_argument("--address", default="auto")
    status.set_defaults(handler=_status)


def _import_ray():
    try:
        import ray
    except ImportError:
        print("error: Ray is not installed: pip install 'specmesh[ray]'", file=sys.stderr)
        return None
    return ray


def _up(args: argparse.Namespace) -> int:
    from client.ray_cluster import RayCluster, load_ray_config

    ray = _import_ray()
    if ray is None:
        return EXIT_USAGE
    try:
        config = load_ray_config(args.config)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.namespace:
        config.namespace = args.namespace
    detached = bool(args.address)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if detached:
        ray.init(address=args.address, namespace=config.namespace, log_to_driver=False)
    else:
        ray.init(namespace=config.namespace, log_to_driver=False, **config.local)
    cluster = RayCluster(config, detached=detached)
    try:
        cluster.up(args.timeout_s)
        for name, replica in cluster.replicas.items():
            info = cluster.info(name)
            print(f"  {name:<14} {replica.spec.kind:<11} {info['address']:<21} node {info['node_id'][:12]}  log {info['log']}")
        if detached:
            print(f"placed in namespace {config.namespace!r}; stop with: specmesh ray down --address {args.address} "
                  f"--namespace {config.namespace}", flush=True)
            return EXIT_OK
        print("serving on a local Ray cluster; Ctrl-C drains and stops", flush=True)
        signal.signal(signal.SIGTERM, _interrupt)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("draining", flush=True)
        cluster.down(args.grace_s)
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - reported, the replicas already stopped by `up`
        print(f"ray up failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if not detached:
            ray.shutdown()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _namespace(args: argparse.Namespace) -> str:
    from client.ray_cluster import DEFAULT_NAMESPACE

    return args.namespace or DEFAULT_NAMESPACE


def _down(args: argparse.Namespace) -> int:
    from client.ray_cluster import down

    ray = _import_ray()
    if ray is None:
        return EXIT_USAGE
    ray.init(address=args.address, namespace=_namespace(args), log_to_driver=False)
    stopped = down(_namespace(args), args.grace_s)
    print(f"stopped {len(stopped)} replica(s) in namespace {_namespace(args)!r}: {', '.join(stopped) or '-'}")
    return EXIT_OK


def _status(args: argparse.Namespace) -> int:
    from coordinator.discovery import REGISTRY_NAME

    ray = _import_ray()
    if ray is None:
        return EXIT_USAGE
    ray.init(address=args.address, namespace=_namespace(args), log_to_driver=False)
    try:
        registry = ray.get_actor(REGISTRY_NAME, namespace=_namespace(args))
    except ValueError:
        print(f"no specmesh cluster in namespace {_namespace(args)!r}", file=sys.stderr)
        return EXIT_FAILED
    for name, (kind, address) in sorted(ray.get(registry.entries.remote(), timeout=30).items()):
        print(f"  {name:<14} {kind:<11} {address}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """`python -m client.ray_cli up ...` (the same as `specmesh ray up ...` once the CLI registers it)."""
    parser = argparse.ArgumentParser(prog="specmesh")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["ray", *(sys.argv[1:] if argv is None else argv)])
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
