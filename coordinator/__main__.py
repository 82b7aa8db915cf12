"""python -m coordinator: serve the user-facing Coordinator over gRPC."""

from __future__ import annotations

import sys

from coordinator.options import CoordinatorOptions
from coordinator.server import create_server
from servicekit.server import serve_main


def main(argv=None) -> int:
    return serve_main(CoordinatorOptions, create_server, argv, "specmesh Coordinator: speculative decoding over the services",
                      lambda o: f"coordinator ({o.default_mode}, verify {o.verify_addresses}, draft {o.draft_addresses or 'none'})")


if __name__ == "__main__":
    sys.exit(main())
