"""`specmesh k8s render`: each config's manifests pass the Kubernetes API schemas offline
(kubernetes-validate, strict: unknown fields fail), probe the gRPC health service, outlast the drain,
carry no secret material, request GPUs for cuda devices, expose headless Services for discovery; and
the committed kustomize base is what the renderer writes today."""

import argparse
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from client import k8s_cli
from client.k8s_cli import kustomize_base, option_defaults, render_config
from specmesh.deploy.k8s import QUEUE_DEPTH_METRIC, K8sSettings, Workload, render

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))  # not configs/sim/: simulator configs
BASE_DIR = ROOT / "deploy" / "k8s" / "base"
BASE_CONFIG = "configs/local.yaml"
GPU_OVERLAY = ROOT / "deploy" / "k8s" / "overlays" / "gpu"
KUBERNETES_VERSIONS = ("1.27", "1.37")  # gRPC probes are GA from 1.27; the newest schemas the package ships
GRPC_KINDS = ("draft", "verify", "stage", "coordinator")


def _of(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def _container(deployment):
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _flags(container) -> dict[str, str]:
    args = container["args"]
    assert len(args) % 2 == 0 and all(a.startswith("--") for a in args[::2]), args
    return dict(zip(args[::2], args[1::2]))


def _component(doc) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def _validate(doc, version):
    kubernetes_validate.validate(doc, version, strict=True)


def _write_config(tmp_path, config: dict) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module", params=[p.name for p in CONFIGS])
def rendered(request):
    return render_config(ROOT / "configs" / request.param, namespace="llm")


def test_configs_are_found():
    assert {"local.yaml", "local-multi-gpu.yaml", "multi-host.example.yaml"} <= {p.name for p in CONFIGS}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_document_passes_the_api_schemas(rendered, version):
    for doc in rendered:
        _validate(doc, version)


def test_the_validator_rejects_a_broken_manifest():
    deployment = _of(render_config(ROOT / BASE_CONFIG), "Deployment")[0]
    _container(deployment)["readinessProbe"]["grpc"]["port"] = "not-a-port"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(deployment, KUBERNETES_VERSIONS[-1])
    typo = render_config(ROOT / BASE_CONFIG)[1]
    typo["spec"]["template"]["spec"]["terminationGracePeriod"] = 30  # strict: an unknown field fails
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(typo, KUBERNETES_VERSIONS[-1])


def test_probes_ask_the_grpc_health_service(rendered):
    for deployment in _of(rendered, "Deployment"):
        container = _container(deployment)
        flags = _flags(container)
        kind = _component(deployment)
        probes = [container[name] for name in ("startupProbe", "readinessProbe", "livenessProbe")]
        if kind == "gateway":
            assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        elif "--tls-cert" in flags:  # the kubelet's gRPC probe speaks no TLS: the CLI asks grpc.health.v1
            for probe in probes:
                command = probe["exec"]["command"]
                assert command[:3] == ["specmesh", "health", f"localhost:{flags['--port']}"]
                assert command[command.index("--tls-ca") + 1].startswith("/etc/specmesh/tls/")
        else:
            assert kind in GRPC_KINDS
            for probe in probes:
                assert probe["grpc"] == {"port": int(flags["--port"])}
        grpc_port = [p for p in container["ports"] if p["name"] in ("grpc", "http")][0]
        assert grpc_port["containerPort"] == int(flags["--port"])
        assert flags["--host"] == "0.0.0.0"


def test_the_grace_period_covers_the_drain(rendered):
    for deployment in _of(rendered, "Deployment"):
        container = _container(deployment)
        drain_s = float(_flags(container).get("--drain-grace-s", option_defaults(_component(deployment))["drain_grace_s"]))
        pre_stop_s = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain_s + pre_stop_s


def test_a_longer_drain_gets_a_longer_grace_period(tmp_path):
    path = _write_config(tmp_path, {"services": {"verify": {"kind": "verify", "port": 50052, "drain_grace_s": 600.5}}})
    (deployment,) = _of(render_config(path), "Deployment")
    assert _flags(_container(deployment))["--drain-grace-s"] == "600.5"
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 601 + 5


def test_no_secret_material_in_the_manifests(rendered):
    for doc in rendered:
        assert not (doc["kind"] == "Secret" and ({"data", "stringData"} & set(doc))), doc["metadata"]["name"]
        assert "-----BEGIN" not in yaml.safe_dump(doc)
    for deployment in _of(rendered, "Deployment"):
        flags = _flags(_container(deployment))
        mounts = {m["mountPath"]: m["name"] for m in _container(deployment)["volumeMounts"]}
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        for flag in ("--tls-cert", "--tls-key", "--auth-token-file", "--downstream-tls-ca"):
            if flags.get(flag):  # the file is a key of a Secret mounted by name
                directory = flags[flag].rsplit("/", 1)[0]
                assert set(volumes[mounts[directory]]["secret"]) == {"secretName", "defaultMode"}


def test_the_multi_host_example_mounts_its_tls_secret():
    docs = render_config(ROOT / "configs" / "multi-host.example.yaml")
    for deployment in _of(docs, "Deployment"):
        volumes = deployment["spec"]["template"]["spec"]["volumes"]
        assert {"name": "secret-tls", "secret": {"secretName": "specmesh-tls", "defaultMode": 0o440}} in volumes
        assert _flags(_container(deployment))["--tls-cert"] == "/etc/specmesh/tls/tls.crt"


def test_each_principal_mounts_its_own_secret(tmp_path):
    path = _write_config(tmp_path, {
        "k8s": {"secrets": {"tls": "cluster-tls"}},
        "defaults": {"tls_cert": "/x/s.crt", "tls_key": "/x/s.key", "tls_client_ca": "/x/ca.crt", "auth_token_file": "/x/t.yaml"},
        "services": {"verify": {"kind": "verify"},
                     "coordinator": {"kind": "coordinator", "downstream_token_file": "/x/c.token", "downstream_tls_ca": "/x/ca.crt",
                                     "downstream_client_cert": "/x/c.crt", "downstream_client_key": "/x/c.key"},
                     "gateway": {"kind": "gateway", "coordinator_token_file": "/x/g.token"}}})
    docs = render_config(path)
    for doc in docs:
        _validate(doc, KUBERNETES_VERSIONS[-1])
    secrets = {_component(d): {v["secret"]["secretName"] for v in d["spec"]["template"]["spec"]["volumes"] if "secret" in v}
               for d in _of(docs, "Deployment")}
    assert secrets == {"verify": {"cluster-tls", "specmesh-auth-tokens"},
                       "coordinator": {"cluster-tls", "specmesh-auth-tokens", "specmesh-coordinator-token", "specmesh-coordinator-client-tls"},
                       "gateway": {"cluster-tls", "specmesh-api-keys", "specmesh-gateway-token"}}
    (coordinator,) = [d for d in _of(docs, "Deployment") if _component(d) == "coordinator"]
    flags = _flags(_container(coordinator))
    assert flags["--downstream-token-file"] == "/etc/specmesh/coordinator-token/token"
    assert flags["--downstream-client-cert"] == "/etc/specmesh/coordinator-client-tls/tls.crt"
    probe = _container(coordinator)["readinessProbe"]["exec"]["command"]
    assert probe[probe.index("--client-cert") + 1] == "/etc/specmesh/tls/tls.crt"  # mTLS: the pod's own certificate


@pytest.mark.parametrize("k8s_section, match", [
    ({"secrets": {"tls": {"tls.key": "c2VjcmV0"}}}, "never its content"),
    ({"secrets": {"tls": "Not_A_Name"}}, "never its content"),
    ({"env": {"HF_TOKEN": "hf_abc"}}, "belong in a Secret"),
    ({"env": {"EXTRA": "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----"}}, "inline key"),
    ({"secret": {"tls": "x"}}, "unknown key"),
])
def test_inline_secret_material_is_refused(tmp_path, k8s_section, match):
    path = _write_config(tmp_path, {"k8s": k8s_section, "services": {"verify": {"kind": "verify"}}})
    with pytest.raises(ValueError, match=match):
        render_config(path)


def test_an_inline_certificate_in_a_service_option_is_refused(tmp_path):
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    path = _write_config(tmp_path, {"services": {"verify": {"kind": "verify", "trusted_callers": pem}}})
    with pytest.raises(ValueError, match="inline key or certificate"):
        render_config(path)


def test_cuda_devices_request_gpus():
    docs = render_config(ROOT / "configs" / "local-multi-gpu.yaml")
    model_deployments = [d for d in _of(docs, "Deployment") if _component(d) in ("draft", "verify", "stage")]
    assert {_component(d) for d in model_deployments} == {"draft", "verify", "stage"}
    for deployment in model_deployments:
        container = _container(deployment)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert _flags(container)["--device"] == "cuda:0"  # the pod's one GPU, whatever index the host file named
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in deployment["spec"]["template"]["spec"]["tolerations"]
    (coordinator,) = [d for d in _of(docs, "Deployment") if _component(d) == "coordinator"]
    assert "nvidia.com/gpu" not in yaml.safe_dump(coordinator)
    assert "nvidia.com/gpu" not in yaml.safe_dump(render_config(ROOT / BASE_CONFIG))


def test_headless_services_select_each_deployment(rendered):
    services = {s["metadata"]["name"]: s for s in _of(rendered, "Service")}
    for deployment in _of(rendered, "Deployment"):
        name = deployment["metadata"]["name"]
        headless = services[f"{name}-headless"]
        assert headless["spec"]["clusterIP"] == "None"
        assert headless["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert headless["spec"]["selector"].items() <= labels.items()
        if _component(deployment) in ("coordinator", "gateway"):
            assert services[name]["spec"]["type"] == "ClusterIP"


def test_the_coordinator_discovers_replicas_through_dns():
    docs = render_config(ROOT / BASE_CONFIG, namespace="llm")
    deployments = {_component(d): d for d in _of(docs, "Deployment")}
    flags = _flags(_container(deployments["coordinator"]))
    assert flags["--draft-addresses"] == "dns:///specmesh-draft-headless.llm.svc.cluster.local:50051"
    assert flags["--verify-addresses"] == "dns:///specmesh-verify-headless.llm.svc.cluster.local:50052"
    assert _flags(_container(deployments["gateway"]))["--coordinator"] == "specmesh-coordinator.llm.svc.cluster.local:50050"


def test_replicas_share_one_port():
    docs = render_config(ROOT / "configs" / "multi-host.example.yaml")
    (verify,) = [d for d in _of(docs, "Deployment") if _component(d) == "verify"]
    assert verify["spec"]["replicas"] == 2
    assert _flags(_container(verify))["--port"] == "50052"
    assert _flags(_container(verify))["--metrics-port"] == "9152"


def test_every_flag_is_an_option_of_its_kind(rendered):
    for deployment in _of(rendered, "Deployment"):
        known = {"--" + name.replace("_", "-") for name in option_defaults(_component(deployment))}
        assert set(_flags(_container(deployment))) <= known


def test_verify_has_a_disruption_budget_and_a_queue_depth_autoscaler(rendered):
    verify_names = {d["metadata"]["name"] for d in _of(rendered, "Deployment") if _component(d) == "verify"}
    assert {p["metadata"]["name"] for p in _of(rendered, "PodDisruptionBudget")} == verify_names
    for hpa in _of(rendered, "HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"]["name"] in verify_names
        assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == QUEUE_DEPTH_METRIC


def test_the_autoscaled_metric_is_the_services_queue_depth():
    from servicekit.metrics import ServiceMetrics

    names = {metric.name for metric in ServiceMetrics("verify").registry.collect()}
    assert QUEUE_DEPTH_METRIC in names


def test_the_config_map_holds_the_cluster_yaml(rendered):
    (config_map,) = _of(rendered, "ConfigMap")
    cluster = yaml.safe_load(config_map["data"]["cluster.yaml"])
    assert set(cluster["services"]) == {d["metadata"]["name"].removeprefix("specmesh-") for d in _of(rendered, "Deployment")}


def test_k8s_section_sets_pools_resources_and_cache(tmp_path):
    path = _write_config(tmp_path, {
        "k8s": {"namespace": "edge", "model_cache": {"pvc": "models"},
                "pools": {"draft": {"node_selector": {"specmesh.io/pool": "edge"}}},
                "resources": {"draft": {"requests": {"cpu": "3"}}}, "hpa": {"enabled": False}},
        "services": {"draft": {"kind": "draft", "port": 50051}, "verify": {"kind": "verify", "port": 50052}}})
    docs = render_config(path)
    deployments = {_component(d): d for d in _of(docs, "Deployment")}
    draft = deployments["draft"]["spec"]["template"]["spec"]
    assert draft["nodeSelector"] == {"specmesh.io/pool": "edge"}
    assert "nodeSelector" not in deployments["verify"]["spec"]["template"]["spec"]
    assert {"name": "OMP_NUM_THREADS", "value": "3"} in draft["containers"][0]["env"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}} in draft["volumes"]
    assert {d["metadata"]["namespace"] for d in docs} == {"edge"}
    assert not _of(docs, "HorizontalPodAutoscaler")


def test_replicas_that_differ_beyond_a_gpu_index_are_refused(tmp_path):
    path = _write_config(tmp_path, {"services": {"verify": {"kind": "verify", "replicas": 2, "model": ["default", "other"]}}})
    with pytest.raises(ValueError, match="replicas differ in model"):
        render_config(path)


def test_a_workload_name_must_be_a_dns_label():
    workload = Workload("Verify_1", "verify", "target_service", 1, {}, option_defaults("verify"))
    with pytest.raises(ValueError, match="DNS labels"):
        render([workload], K8sSettings(), "services: {}\n")


def test_the_committed_base_is_what_the_renderer_writes():
    expected = kustomize_base(BASE_CONFIG, "deploy/k8s/base")
    committed = {p.name: p.read_text() for p in BASE_DIR.iterdir() if p.is_file()}
    regenerate = "regenerate: specmesh k8s render configs/local.yaml --base deploy/k8s/base"
    assert set(committed) == set(expected), regenerate
    for name, text in expected.items():
        assert committed[name] == text, f"deploy/k8s/base/{name} is stale; {regenerate}"


def test_the_gpu_overlay_changes_only_device_and_dtype():
    base = {d["metadata"]["name"]: d for path in BASE_DIR.glob("specmesh-*.yaml") for d in yaml.safe_load_all(path.read_text())
            if d["kind"] == "Deployment"}
    kustomization = yaml.safe_load((GPU_OVERLAY / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../../base"]
    for patch_ref in kustomization["patches"]:
        patch = yaml.safe_load((GPU_OVERLAY / patch_ref["path"]).read_text())
        (container,) = patch["spec"]["template"]["spec"]["containers"]
        base_flags = _flags(_container(base[patch["metadata"]["name"]]))
        flags = _flags(container)
        assert list(flags) == list(base_flags)
        assert {k for k in flags if flags[k] != base_flags[k]} <= {"--device", "--dtype"}
        assert flags["--device"] == "cuda:0"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its built-in kustomize) is not installed")
@pytest.mark.parametrize("directory", [BASE_DIR, GPU_OVERLAY], ids=["base", "gpu"])
def test_kustomize_builds_valid_manifests(directory):
    built = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    assert len(docs) == len(render_config(ROOT / BASE_CONFIG))
    for doc in docs:
        _validate(doc, KUBERNETES_VERSIONS[-1])


def test_the_cli_writes_the_manifests(tmp_path):
    parser = argparse.ArgumentParser(prog="specmesh")
    k8s_cli.register(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "specmesh.yaml"
    args = parser.parse_args(["k8s", "render", str(ROOT / BASE_CONFIG), "-o", str(out), "--namespace", "llm", "--image", "r/specmesh:1"])
    assert args.handler(args) == 0
    docs = [d for d in yaml.safe_load_all(out.read_text()) if d]
    assert docs == render_config(ROOT / BASE_CONFIG, namespace="llm", image="r/specmesh:1")
    assert {_container(d)["image"] for d in _of(docs, "Deployment")} == {"r/specmesh:1"}
    bad = parser.parse_args(["k8s", "render", str(tmp_path / "missing.yaml")])
    assert bad.handler(bad) == 2
