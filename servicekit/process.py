"""This process as its launcher started it: how many times the launcher restarted the service and how
the previous process ended. The launcher (`client/cluster.py`) passes both in the environment of a
restarted process; every service reports them in `GetInfo` (the coordinator in `GetStats`), so
`specmesh health` and `specmesh stats` show a restart without reading the launcher's log.
"""

from __future__ import annotations

import os
import time

from specmesh.proto.v1 import common_pb2

NUM_RESTARTS_ENV = "SPECMESH_NUM_RESTARTS"  # set by the launcher on a restart: 1, 2, ...
LAST_EXIT_ENV = "SPECMESH_LAST_EXIT"  # set by the launcher on a restart, e.g. "killed by SIGKILL"

_STARTED_S = time.monotonic()  # this module is imported as the service starts


def num_restarts() -> int:
    try:
        return max(0, int(os.environ.get(NUM_RESTARTS_ENV, "0")))
    except ValueError:
        return 0


def process_info_pb(settling: bool = False) -> common_pb2.ProcessInfo:
    return common_pb2.ProcessInfo(pid=os.getpid(), num_restarts=num_restarts(), uptime_s=time.monotonic() - _STARTED_S,
                                  last_exit=os.environ.get(LAST_EXIT_ENV, ""), settling=settling)
