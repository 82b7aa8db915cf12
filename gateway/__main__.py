"""python -m gateway: serve the OpenAI-compatible HTTP API in front of a Coordinator.

    python -m gateway --port 8000 --coordinator 127.0.0.1:50050 --model default \
        [--auth-token-file users.yaml] [--coordinator-token-file gateway.token]

SIGINT / SIGTERM: stop accepting, let open requests finish for up to --drain-grace-s, then stop;
a second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys


def main(argv=None) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(f"the gateway needs starlette and uvicorn ({exc}): pip install 'specmesh[gateway]'", file=sys.stderr)
        return 2
    from gateway.options import GatewayOptions
    from gateway.server import create_gateway
    from servicekit.options import parse_options

    options = parse_options(GatewayOptions, argv, "specmesh gateway: the OpenAI API over a Coordinator")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def serve() -> None:
        handle, port = await create_gateway(options)
        scheme = "https" if options.tls_cert else "http"
        print(f"gateway ({options.model_name} via coordinator {options.coordinator}) listening on "
              f"{scheme}://{options.host}:{port}/v1", flush=True)
        signals = 0

        def on_signal() -> None:
            nonlocal signals
            signals += 1
            if signals == 1:
                logging.getLogger("specmesh.gateway").info("draining: up to %.1f s for open requests; a second signal "
                                                           "stops at once", options.drain_grace_s)
                handle.drain(options.drain_grace_s)
            else:
                handle.force()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        await handle.wait_for_termination()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
