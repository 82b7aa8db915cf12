"""Cluster simulator: plan deployments of many draft devices and target servers in virtual time.

  config.py    `SimConfig` from YAML (`load_config`), dotted overrides for sweeps
  cost.py      forward-time models: `CostTable` (measured), `RooflineCost` (datasheets), `LinearCost`
  profile.py   `profile_engine`: measure a real engine into a `CostTable`
  workload.py  request sizes, conversations, the acceptance model (per position or a trace)
  servers.py   engines (own device, or a shared host's cores), links; `TargetServer`, the Verify batcher
  cluster.py   `Simulation`: clients, the coordinator's session loop and routers, one run
  results.py   per-request records and the summary (throughput, goodput, percentiles, Little's law)
  report.py    JSON / CSV (/ PNG) outputs and `sweep`
  cli.py       `specmesh sim run | sweep | profile`

Routing is `specmesh.routing` as-is (a `ReplicaSet` on the virtual clock), so simulated and live
replica choice cannot diverge. The round's accounting follows `specmesh.decoding.state`: k is capped
so a round never emits past max_new_tokens, and a round emits accepted + 1 tokens.
"""

from specmesh.sim.cluster import Simulation, simulate
from specmesh.sim.config import SimConfig, config_from_dict, load_config
from specmesh.sim.cost import CostTable, DeviceSpec, LinearCost, ModelDims, RooflineCost
from specmesh.sim.results import SimResult

__all__ = ["CostTable", "DeviceSpec", "LinearCost", "ModelDims", "RooflineCost", "SimConfig", "SimResult", "Simulation",
           "config_from_dict", "load_config", "simulate"]
