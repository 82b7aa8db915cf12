"""specmesh-verify / python -m target_service: serve the target model's Verify service over gRPC."""

from __future__ import annotations

import sys

from servicekit.server import serve_main
from target_service.options import VerifyOptions
from target_service.server import create_server


def main(argv=None) -> int:
    return serve_main(VerifyOptions, create_server, argv, "specmesh Verify (target) service",
                      lambda o: f"verify service ({o.model}, {o.device}, {o.dtype})")


if __name__ == "__main__":
    sys.exit(main())
