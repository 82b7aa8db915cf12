"""specmesh-stage / python -m stage_service: serve a cascade stage over gRPC."""

from __future__ import annotations

import sys

from servicekit.server import serve_main
from stage_service.options import StageOptions
from stage_service.server import create_server


def main(argv=None) -> int:
    return serve_main(StageOptions, create_server, argv, "specmesh Stage service", lambda o: f"stage service ({o.model})")


if __name__ == "__main__":
    sys.exit(main())
