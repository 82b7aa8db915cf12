"""specmesh-verify / python -m target_service: serve the target model's Verify service over gRPC."""

from __future__ import annotations

import sys

from servicekit.options import parse_options
from servicekit.server import run_until_signalled
from target_service.options import VerifyOptions
from target_service.server import create_server


def main(argv=None) -> int:
    options = parse_options(VerifyOptions, argv, "specmesh Verify (target) service")

    async def start():
        return (await create_server(options))[0]

    return run_until_signalled(start, lambda h: f"verify service ({options.model}, {options.device}, {options.dtype}) listening on "
                               f"{options.host}:{h.port}" + (f", metrics on :{h.metrics_port}" if h.metrics_port else ""))


if __name__ == "__main__":
    sys.exit(main())
