"""Cluster YAML -> Kubernetes manifests: a Deployment per service entry, Services for discovery.

    workloads = workloads_from_config("configs/local.yaml")   # client/k8s_cli.py: one Workload per entry
    settings = K8sSettings.from_mapping(config.get("k8s"), namespace="prod")
    docs = render(workloads, settings, cluster_yaml_text)       # [{"kind": "Deployment", ...}, ...]
    print(dump_yaml(docs))                                      # for `kubectl apply -f -`

What changes from `make run-cluster` on one host:
- every pod of a service listens on the config's `port` on 0.0.0.0 (each pod has its own IP: no
  port + i); `metrics_port` is DEFAULT_METRICS_PORT where the config leaves metrics off (scraping, HPA);
- a `cuda:N` device is `cuda:0` inside its pod, which requests one `nvidia.com/gpu`;
- the coordinator reaches its replicas through headless Services,
  `dns:///<prefix>-<entry>-headless.<namespace>.svc.<domain>:<port>` (coordinator/discovery.py re-reads
  the records every `discovery_interval_s`); the gateway reaches the coordinator's ClusterIP Service;
- token files and TLS material come from Secrets mounted by name (SECRET_FILES): nothing renders a
  Secret, and a config that carries secret material inline is refused.

The optional `k8s:` section of the cluster YAML (every key optional; see K8sSettings):

    k8s:
      namespace: specmesh
      image: registry.example.com/specmesh:0.1.0-cuda
      model_cache: {pvc: specmesh-models}          # default: an emptyDir per pod
      pools:                                       # pool per kind: draft; target (verify, stage); front
        draft: {node_selector: {specmesh.io/pool: edge}}
        target: {node_selector: {specmesh.io/pool: gpu}, tolerations: [{key: dedicated, operator: Exists}]}
      resources: {verify: {requests: {cpu: "8", memory: 32Gi}}}   # by entry name or kind
      secrets: {tls: my-tls-secret}                # Secret names (never their content)
      hpa: {max_replicas: 8, queue_depth_per_pod: "4"}
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

GRPC_KINDS = ("draft", "verify", "stage", "coordinator")  # serve grpc.health.v1 on their port; the gateway is HTTP
POOL_OF_KIND = {"draft": "draft", "verify": "target", "stage": "target", "coordinator": "front", "gateway": "front"}
DEFAULT_METRICS_PORT = 9090
QUEUE_DEPTH_METRIC = "specmesh_queue_depth"  # servicekit/metrics.py: calls waiting for the engine
COORDINATOR_ADDRESS_OPTIONS = {"draft": "draft_addresses", "verify": "verify_addresses"}
MODEL_CACHE_DIR = "/var/cache/specmesh"  # SPECMESH_HOME: weights fetched / converted at start, kept on a volume
CLUSTER_CONFIG_DIR = "/etc/specmesh/cluster"
SECRETS_DIR = "/etc/specmesh"
RUN_AS_ID = 10001  # the image's non-root user (Dockerfile)
HPA_KEYS = frozenset({"enabled", "kinds", "max_replicas", "queue_depth_per_pod"})
MODEL_CACHE_KEYS = frozenset({"pvc", "size_limit"})
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
INLINE_SECRET = re.compile(r"-----BEGIN [A-Z ]*(PRIVATE KEY|CERTIFICATE)-----")
SECRET_ENV_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PRIVATE|CREDENTIAL|API_?KEY", re.IGNORECASE)
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")

# option -> (secret role, key inside that Secret): the file options of every kind, served from mounted Secrets.
# Each principal has its own Secret: a coordinator's token is not the gateway's.
SECRET_FILES = {
    "auth_token_file": ("auth-tokens", "tokens.yaml"),  # principal name -> token mapping this service accepts
    "downstream_token_file": ("coordinator-token", "token"),  # the coordinator's token toward the services
    "coordinator_token_file": ("gateway-token", "token"),  # the gateway's token toward the coordinator
    "tls_cert": ("tls", "tls.crt"),
    "tls_key": ("tls", "tls.key"),
    "tls_client_ca": ("tls", "ca.crt"),
    "downstream_tls_ca": ("tls", "ca.crt"),
    "coordinator_tls_ca": ("tls", "ca.crt"),
    "downstream_client_cert": ("coordinator-client-tls", "tls.crt"),
    "downstream_client_key": ("coordinator-client-tls", "tls.key"),
    "coordinator_client_cert": ("gateway-client-tls", "tls.crt"),
    "coordinator_client_key": ("gateway-client-tls", "tls.key"),
}
GATEWAY_SECRET_FILES = {"auth_token_file": ("api-keys", "tokens.yaml")}  # the gateway's: user name -> API key
SECRET_ROLES = frozenset(role for role, _ in [*SECRET_FILES.values(), *GATEWAY_SECRET_FILES.values()])
DEFAULT_RESOURCES = {  # sized for the default model on CPU (a kind node of 4 cores); override under k8s.resources
    "draft": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "6Gi"}},
    "verify": {"requests": {"cpu": "2", "memory": "2Gi"}, "limits": {"memory": "6Gi"}},
    "stage": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "6Gi"}},
    "coordinator": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
    "gateway": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
}


@dataclass(frozen=True)
class Workload:
    """One service entry of a cluster YAML: `replicas` identical pods."""

    name: str  # the entry's name in the YAML, e.g. "verify"
    kind: str  # draft | verify | stage | coordinator | gateway
    module: str  # run as `python -m <module>`
    replicas: int
    options: Mapping[str, Any]  # the flags the YAML gives (defaults merged, replica 0's list items)
    defaults: Mapping[str, Any]  # every option of the kind -> its default
    torch_threads: int = 0  # as the YAML says; 0 = the pod's CPU request

    def option(self, name: str) -> Any:
        return self.options.get(name, self.defaults.get(name))


@dataclass(frozen=True)
class Pool:
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()


@dataclass(frozen=True)
class K8sSettings:
    namespace: str = "default"
    image: str = "specmesh:latest"
    image_pull_policy: str = "IfNotPresent"  # a `kind load`-ed image is never pulled
    name_prefix: str = "specmesh"
    cluster_domain: str = "cluster.local"
    pre_stop_s: int = 5  # endpoints drop the pod before SIGTERM starts the drain
    grace_margin_s: int = 15  # terminationGracePeriodSeconds = pre_stop_s + drain_grace_s + this
    startup_timeout_s: int = 900  # first start fetches and converts the model: the startup probe waits this long
    model_cache: Mapping[str, Any] = field(default_factory=dict)  # {pvc: NAME} or {size_limit: 20Gi} (emptyDir)
    pools: Mapping[str, Pool] = field(default_factory=dict)
    resources: Mapping[str, Mapping[str, Mapping[str, str]]] = field(default_factory=dict)
    gpu_resource: str = "nvidia.com/gpu"
    secrets: Mapping[str, str] = field(default_factory=dict)  # role (SECRET_FILES) -> Secret name
    hpa: Mapping[str, Any] = field(default_factory=dict)  # {enabled, kinds, max_replicas, queue_depth_per_pod}
    env: Mapping[str, str] = field(default_factory=dict)  # extra plain environment for every container

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | None, **overrides: Any) -> K8sSettings:
        """From a cluster YAML's `k8s:` section; `overrides` (the CLI's --namespace, --image) win where not None."""
        values = dict(mapping or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"k8s: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        refuse_inline_secrets(values, "k8s")
        pools = values.get("pools") or {}
        bad_pools = sorted(set(pools) - set(POOL_OF_KIND.values()))
        if bad_pools:
            raise ValueError(f"k8s.pools: unknown pool(s) {', '.join(bad_pools)}; pools are draft, target, front")
        for key, allowed in (("hpa", HPA_KEYS), ("model_cache", MODEL_CACHE_KEYS)):
            extra = sorted(set(values.get(key) or {}) - allowed)
            if extra:
                raise ValueError(f"k8s.{key}: unknown key(s) {', '.join(extra)}; known: {', '.join(sorted(allowed))}")
        values["pools"] = {name: Pool(dict(p.get("node_selector") or {}), list(p.get("tolerations") or []))
                           for name, p in pools.items()}
        for role, name in (values.get("secrets") or {}).items():
            if role not in SECRET_ROLES:
                raise ValueError(f"k8s.secrets: unknown role {role!r}; roles: {', '.join(sorted(SECRET_ROLES))}")
            if not isinstance(name, str) or not DNS_LABEL.match(name):
                raise ValueError(f"k8s.secrets.{role}: give the name of an existing Secret, never its content")
        for name in values.get("env") or {}:
            if SECRET_ENV_NAME.search(name):
                raise ValueError(f"k8s.env.{name}: secret values belong in a Secret (k8s.secrets), not in the manifest")
        settings = cls(**values)
        if not DNS_LABEL.match(settings.namespace) or not DNS_LABEL.match(settings.name_prefix):
            raise ValueError("k8s: namespace and name_prefix must be DNS labels (lower case, digits, '-')")
        return settings

    def secret_name(self, role: str) -> str:
        return self.secrets.get(role, f"{self.name_prefix}-{role}")


def refuse_inline_secrets(value: Any, where: str) -> None:
    """Raise where a PEM key or certificate is written into the config itself (it would land in a manifest)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            refuse_inline_secrets(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            refuse_inline_secrets(item, f"{where}[{index}]")
    elif isinstance(value, str) and INLINE_SECRET.search(value):
        raise ValueError(f"{where}: inline key or certificate material; put it in a Secret and name the file")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _argv(options: Mapping[str, Any]) -> list[str]:
    argv: list[str] = []
    for key, value in options.items():
        argv += [_flag(key), str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


def _cpu_threads(cpu: str) -> int:
    """Intra-op threads for a CPU request (whole cores, at least one).

    >>> [_cpu_threads(cpu) for cpu in ("2", "1.5", "500m", "2500m")]
    [2, 1, 1, 2]
    """
    cores = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
    return max(1, math.floor(cores))


class _Renderer:
    def __init__(self, workloads: Sequence[Workload], settings: K8sSettings, cluster_yaml: str):
        self.workloads, self.settings, self.cluster_yaml = workloads, settings, cluster_yaml
        self.config_sha = hashlib.sha256(cluster_yaml.encode()).hexdigest()

    def full_name(self, workload: Workload) -> str:
        return f"{self.settings.name_prefix}-{workload.name}"

    def fqdn(self, service: str) -> str:
        return f"{service}.{self.settings.namespace}.svc.{self.settings.cluster_domain}"

    def port(self, workload: Workload) -> int:
        port = int(workload.option("port") or 0)
        return port if port > 0 else int(workload.defaults["port"])

    def metrics_port(self, workload: Workload) -> int | None:
        if "metrics_port" not in workload.defaults:
            return None  # the gateway serves /metrics on its HTTP port
        port = int(workload.option("metrics_port") or -1)
        return port if port > 0 else DEFAULT_METRICS_PORT

    def labels(self, workload: Workload) -> dict[str, str]:
        return {"app.kubernetes.io/name": "specmesh", "app.kubernetes.io/component": workload.kind,
                "specmesh.io/service": self.full_name(workload)}

    def selector(self, workload: Workload) -> dict[str, str]:
        return {"app.kubernetes.io/name": "specmesh", "specmesh.io/service": self.full_name(workload)}

    def meta(self, name: str, workload: Workload | None = None) -> dict[str, Any]:
        labels = self.labels(workload) if workload else {"app.kubernetes.io/name": "specmesh"}
        return {"name": name, "namespace": self.settings.namespace, "labels": labels}

    def pod_options(self, workload: Workload) -> tuple[dict[str, Any], set[str]]:
        """The flags of a pod, and the Secret roles they read files from."""
        options = dict(workload.options)
        options["host"] = "0.0.0.0"  # the pod's IP, not loopback
        options["port"] = self.port(workload)
        metrics_port = self.metrics_port(workload)
        if metrics_port is not None:
            options["metrics_port"] = metrics_port
        if str(options.get("device", "")).startswith("cuda"):
            options["device"] = "cuda:0"  # the one GPU the pod is given
        roles: set[str] = set()
        secret_files = {**SECRET_FILES, **GATEWAY_SECRET_FILES} if workload.kind == "gateway" else SECRET_FILES
        for key, value in options.items():
            if key in secret_files and value:
                role, item = secret_files[key]
                options[key] = f"{SECRETS_DIR}/{role}/{item}"
                roles.add(role)
        if workload.kind == "coordinator":
            for kind, key in COORDINATOR_ADDRESS_OPTIONS.items():
                targets = [w for w in self.workloads if w.kind == kind]
                if targets and options.get(key) != "":
                    options[key] = ",".join(f"dns:///{self.fqdn(self.full_name(w) + '-headless')}:{self.port(w)}"
                                            for w in targets)
        coordinators = [w for w in self.workloads if w.kind == "coordinator"]
        if workload.kind == "gateway" and coordinators:
            options["coordinator"] = f"{self.fqdn(self.full_name(coordinators[0]))}:{self.port(coordinators[0])}"
        return options, roles

    def resources(self, workload: Workload) -> dict[str, dict[str, str]]:
        override = self.settings.resources.get(workload.name) or self.settings.resources.get(workload.kind) or {}
        base = DEFAULT_RESOURCES[workload.kind]
        merged = {part: {**base.get(part, {}), **(override.get(part) or {})} for part in ("requests", "limits")}
        if str(workload.option("device") or "").startswith("cuda"):
            for part in ("requests", "limits"):  # extended resources: requests must equal limits
                merged[part][self.settings.gpu_resource] = "1"
        return merged

    def probes(self, workload: Workload, options: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """Startup / readiness / liveness on grpc.health.v1 (the gateway: GET /health, TCP for liveness)."""
        timing: dict[str, dict[str, int]] = {"startup": {"periodSeconds": 10, "timeoutSeconds": 5,
                              "failureThreshold": max(1, math.ceil(self.settings.startup_timeout_s / 10))},
                  "readiness": {"periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 2},
                  "liveness": {"periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6}}
        port = int(options["port"])
        tls = bool(options.get("tls_cert"))
        action: dict[str, dict[str, Any]]
        if workload.kind == "gateway":
            http = {"httpGet": {"path": "/health", "port": "http", "scheme": "HTTPS" if tls else "HTTP"}}
            action = {"startup": http, "readiness": http, "liveness": {"tcpSocket": {"port": "http"}}}
        elif tls:  # the kubelet's gRPC probe speaks no TLS: ask the health service with the CLI
            argv = ["specmesh", "health", f"localhost:{port}", "--tls-ca", f"{SECRETS_DIR}/tls/ca.crt"]
            if options.get("tls_client_ca"):  # mTLS: the pod presents its own certificate
                argv += ["--client-cert", f"{SECRETS_DIR}/tls/tls.crt", "--client-key", f"{SECRETS_DIR}/tls/tls.key"]
            exec_probe = {"exec": {"command": argv}}
            action = {name: exec_probe for name in timing}
            timing = {name: {**t, "timeoutSeconds": 20} for name, t in timing.items()}
        else:
            action = {name: {"grpc": {"port": port}} for name in timing}
        return {f"{name}Probe": {**action[name], **timing[name]} for name in timing}

    def volumes(self, workload: Workload, roles: set[str]) -> tuple[list[dict], list[dict]]:
        cache = dict(self.settings.model_cache)
        if cache.get("pvc"):
            cache_volume: dict[str, Any] = {"persistentVolumeClaim": {"claimName": cache["pvc"]}}
        else:
            cache_volume = {"emptyDir": {"sizeLimit": str(cache.get("size_limit", "20Gi"))}}
        volumes: list[dict[str, Any]] = [{"name": "model-cache", **cache_volume}, {"name": "tmp", "emptyDir": {}},
                   {"name": "cluster-config", "configMap": {"name": f"{self.settings.name_prefix}-cluster"}}]
        mounts: list[dict[str, Any]] = [{"name": "model-cache", "mountPath": MODEL_CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"},
                  {"name": "cluster-config", "mountPath": CLUSTER_CONFIG_DIR, "readOnly": True}]
        for role in sorted(roles):
            volumes.append({"name": f"secret-{role}", "secret": {"secretName": self.settings.secret_name(role), "defaultMode": 0o440}})
            mounts.append({"name": f"secret-{role}", "mountPath": f"{SECRETS_DIR}/{role}", "readOnly": True})
        return volumes, mounts

    def env(self, workload: Workload, resources: Mapping[str, Mapping[str, str]]) -> list[dict[str, str]]:
        threads = workload.torch_threads or (_cpu_threads(resources["requests"].get("cpu", "1"))
                                             if workload.kind not in ("coordinator", "gateway") else 1)
        env = {"SPECMESH_HOME": MODEL_CACHE_DIR, "HF_HOME": f"{MODEL_CACHE_DIR}/huggingface", "HOME": "/tmp",
               "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               **{k: str(v) for k, v in self.settings.env.items()}}
        return [{"name": k, "value": v} for k, v in env.items()]

    def deployment(self, workload: Workload) -> dict[str, Any]:
        options, roles = self.pod_options(workload)
        resources = self.resources(workload)
        volumes, mounts = self.volumes(workload, roles)
        port_name = "http" if workload.kind == "gateway" else "grpc"
        ports = [{"name": port_name, "containerPort": options["port"], "protocol": "TCP"}]
        metrics_port = self.metrics_port(workload)
        if metrics_port is not None:
            ports.append({"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"})
        drain_grace_s = float(workload.option("drain_grace_s") or 0)
        grace_s = self.settings.pre_stop_s + math.ceil(drain_grace_s) + self.settings.grace_margin_s
        pool = self.settings.pools.get(POOL_OF_KIND[workload.kind], Pool())
        tolerations = list(pool.tolerations)
        if self.settings.gpu_resource in resources["limits"] and GPU_TOLERATION not in tolerations:
            tolerations.append(GPU_TOLERATION)
        container: dict[str, Any] = {
            "name": workload.kind, "image": self.settings.image, "imagePullPolicy": self.settings.image_pull_policy,
            "command": ["python", "-m", workload.module], "args": _argv(options), "ports": ports,
            "env": self.env(workload, resources), "resources": resources, **self.probes(workload, options),
            "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(self.settings.pre_stop_s)]}}},
            "volumeMounts": mounts,
            "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]}},
        }
        pod: dict[str, Any] = {
            "automountServiceAccountToken": False,  # no service talks to the Kubernetes API
            "terminationGracePeriodSeconds": grace_s,
            "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_ID, "runAsGroup": RUN_AS_ID,
                                "fsGroup": RUN_AS_ID, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [container], "volumes": volumes,
        }
        if pool.node_selector:
            pod["nodeSelector"] = dict(pool.node_selector)
        if tolerations:
            pod["tolerations"] = tolerations
        if workload.replicas > 1:  # replicas on different nodes where possible
            pod["topologySpreadConstraints"] = [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                                 "whenUnsatisfiable": "ScheduleAnyway",
                                                 "labelSelector": {"matchLabels": self.selector(workload)}}]
        annotations = {"specmesh.io/cluster-config-sha256": self.config_sha, "prometheus.io/scrape": "true",
                       "prometheus.io/port": str(metrics_port or options["port"]), "prometheus.io/path": "/metrics"}
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": self.meta(self.full_name(workload), workload),
                "spec": {"replicas": workload.replicas, "selector": {"matchLabels": self.selector(workload)},
                         "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                         "template": {"metadata": {"labels": self.labels(workload), "annotations": annotations},
                                      "spec": pod}}}

    def services(self, workload: Workload) -> list[dict[str, Any]]:
        """A headless Service (DNS: one A record per ready pod) and, for coordinator / gateway, a ClusterIP one."""
        port_name = "http" if workload.kind == "gateway" else "grpc"
        port = {"name": port_name, "port": self.port(workload), "targetPort": port_name, "protocol": "TCP"}
        if workload.kind in GRPC_KINDS:
            port["appProtocol"] = "grpc"
        ports = [port]
        if self.metrics_port(workload) is not None:
            ports.append({"name": "metrics", "port": self.metrics_port(workload), "targetPort": "metrics", "protocol": "TCP"})
        name = self.full_name(workload)
        docs = [{"apiVersion": "v1", "kind": "Service", "metadata": self.meta(f"{name}-headless", workload),
                 "spec": {"clusterIP": "None", "publishNotReadyAddresses": False, "selector": self.selector(workload),
                          "ports": ports}}]
        if workload.kind in ("coordinator", "gateway"):
            docs.append({"apiVersion": "v1", "kind": "Service", "metadata": self.meta(name, workload),
                         "spec": {"type": "ClusterIP", "selector": self.selector(workload), "ports": [port]}})
        return docs

    def disruption_budget(self, workload: Workload) -> dict[str, Any]:
        return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": self.meta(self.full_name(workload), workload),
                "spec": {"maxUnavailable": 1, "selector": {"matchLabels": self.selector(workload)}}}

    def autoscaler(self, workload: Workload) -> dict[str, Any]:
        """Scale on the mean queue depth per pod (served to the HPA by e.g. prometheus-adapter); scale
        down slowly: a removed replica drains its sessions first."""
        hpa = self.settings.hpa
        max_replicas = int(hpa.get("max_replicas") or 4 * workload.replicas)
        return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                "metadata": self.meta(self.full_name(workload), workload),
                "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": self.full_name(workload)},
                         "minReplicas": workload.replicas, "maxReplicas": max(max_replicas, workload.replicas),
                         "metrics": [{"type": "Pods", "pods": {
                             "metric": {"name": QUEUE_DEPTH_METRIC},
                             "target": {"type": "AverageValue", "averageValue": str(hpa.get("queue_depth_per_pod", "4"))}}}],
                         "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300,
                                                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}]}}}}

    def config_map(self) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": self.meta(f"{self.settings.name_prefix}-cluster"),
                "data": {"cluster.yaml": self.cluster_yaml}}


def render(workloads: Sequence[Workload], settings: K8sSettings, cluster_yaml: str) -> list[dict[str, Any]]:
    """The manifests of a cluster: its ConfigMap, then per entry a Deployment, Services, and for
    verify entries a PodDisruptionBudget (and an HPA, unless `k8s.hpa.enabled` is false)."""
    refuse_inline_secrets(yaml.safe_load(cluster_yaml), "config")
    for workload in workloads:
        if not DNS_LABEL.match(f"{settings.name_prefix}-{workload.name}-headless"):
            raise ValueError(f"service {workload.name!r}: its Kubernetes names must be DNS labels (lower case, digits, '-')")
    renderer = _Renderer(workloads, settings, cluster_yaml)
    hpa_kinds = settings.hpa.get("kinds", ["verify"]) if settings.hpa.get("enabled", True) else []
    docs = [renderer.config_map()]
    for workload in workloads:
        docs += [renderer.deployment(workload), *renderer.services(workload)]
        if workload.kind == "verify":
            docs.append(renderer.disruption_budget(workload))
        if workload.kind in hpa_kinds:
            docs.append(renderer.autoscaler(workload))
    return docs


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True  # a probe used three times is written three times: no &anchors for hand editors


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None  # the ConfigMap's cluster YAML stays readable
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_representer)


def dump_yaml(docs: Sequence[Mapping[str, Any]], header: str = "") -> str:
    """Multi-document YAML, keys in the order rendered; `header` lines become comments on top."""
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return comment + yaml.dump_all(list(docs), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def base_files(docs: Sequence[Mapping[str, Any]], header: str = "") -> dict[str, str]:
    """A kustomize base: one file per service entry (its Deployment, Services, PDB, HPA), the
    ConfigMap in cluster-config.yaml, and kustomization.yaml listing them."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for doc in docs:
        service = doc["metadata"]["labels"].get("specmesh.io/service")
        groups.setdefault(f"{service}.yaml" if service else "cluster-config.yaml", []).append(doc)
    files = {name: dump_yaml(group, header) for name, group in groups.items()}
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": list(groups)}
    files["kustomization.yaml"] = dump_yaml([kustomization], header)
    return files
