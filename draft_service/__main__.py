"""specmesh-draft / python -m draft_service: serve a drafter over gRPC."""

from __future__ import annotations

import sys

from draft_service.options import DraftOptions
from draft_service.server import create_server
from servicekit.server import serve_main


def main(argv=None) -> int:
    return serve_main(DraftOptions, create_server, argv, "specmesh Draft service",
                      lambda o: f"draft service ({o.drafter}, {o.model})")


if __name__ == "__main__":
    sys.exit(main())
