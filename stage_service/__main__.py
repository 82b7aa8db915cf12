"""specmesh-stage / python -m stage_service: serve a cascade stage over gRPC."""

from __future__ import annotations

import sys

from servicekit.options import parse_options
from servicekit.server import run_until_signalled
from stage_service.options import StageOptions
from stage_service.server import create_server


def main(argv=None) -> int:
    options = parse_options(StageOptions, argv, "specmesh Stage service")

    async def start():
        return (await create_server(options))[0]

    return run_until_signalled(start, lambda h: f"stage service ({options.model}) listening on {options.host}:{h.port}"
                               + (f", metrics on :{h.metrics_port}" if h.metrics_port else ""))


if __name__ == "__main__":
    sys.exit(main())
