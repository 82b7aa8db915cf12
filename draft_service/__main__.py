"""specmesh-draft / python -m draft_service: serve a drafter over gRPC."""

from __future__ import annotations

import sys

from draft_service.options import DraftOptions
from draft_service.server import create_server
from servicekit.options import parse_options
from servicekit.server import run_until_signalled


def main(argv=None) -> int:
    options = parse_options(DraftOptions, argv, "specmesh Draft service")

    async def start():
        return (await create_server(options))[0]

    return run_until_signalled(start, lambda h: f"draft service ({options.drafter}, {options.model}) listening on "
                               f"{options.host}:{h.port}" + (f", metrics on :{h.metrics_port}" if h.metrics_port else ""))


if __name__ == "__main__":
    sys.exit(main())
