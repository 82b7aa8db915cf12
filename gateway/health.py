"""Wait for a gateway to be healthy (stdlib only, so launchers need neither starlette nor httpx).

    wait_healthy("127.0.0.1:8000", time.monotonic() + 60, process)   # GET /health answered 200

/health is 200 only once the gateway serves and its Coordinator reports SERVING.
"""

from __future__ import annotations

import ssl
import subprocess
import time
import urllib.error
import urllib.request


def wait_healthy(address: str, deadline_s: float, process: subprocess.Popen | None = None, *, tls_ca: str = "",
                 https: bool = False, interval_s: float = 0.1) -> None:
    """Poll GET http(s)://address/health until 200; raise if `process` exits or the deadline passes."""
    context = ssl.create_default_context(cafile=tls_ca or None) if https or tls_ca else None
    url = f"{'https' if context else 'http'}://{address}/health"
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the gateway for {address} exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1.0, context=context) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"the gateway at {address} did not report healthy in time")
        time.sleep(interval_s)
