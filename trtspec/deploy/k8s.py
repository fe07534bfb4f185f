"""Kubernetes manifests for a deployed repository: `trtspec deploy -c CONFIG --repo R --k8s OUT`.

- deployment.yaml: one pod running `trtspec serve` (the image of docker/Dockerfile) on the repository. Triton's HTTP
  and gRPC APIs listen on the pod's loopback only; the public surface is the OpenAI front on port 9000, which asks
  every request but /health for the API key, and the metrics port 8002 is open for Prometheus. The API and admin keys
  come from the Secret `<name>-keys` (never written here: the header comment says how to create it). The pod runs
  under the Pod Security Standards' "restricted" profile (non-root, no privilege escalation, no capabilities, seccomp
  RuntimeDefault, a read-only root filesystem with emptyDirs for what is written) with no service-account token, CPU
  and memory requests and limits, the GPUs the placement uses, the engine volume (a PersistentVolumeClaim holding
  the engines and the repository at the paths `trtspec deploy` wrote into the configs, mounted read-only), /dev/shm
  for the Python backend, and probes on the front's /health (a startup probe gives engine loading at least 30
  minutes, more for engines `trtspec serve` waits longer for) and /health/live (the liveness probe restarts a pod
  whose target fails every call, or whose models stay unready for longer than loading them takes).
- service.yaml: the front (9000) and the metrics (8002); Triton's own 8000/8001 are not reachable from outside the pod.
- networkpolicy.yaml: ingress to the front's port from anywhere, to the metrics port only from the namespace
  `monitoring`; nothing else.
- hpa.yaml: an example HorizontalPodAutoscaler on Triton's queue gauge `nv_inference_pending_request_count` of the
  BLS model; it needs a metrics adapter (e.g. Prometheus Adapter) that serves that metric as a pods metric.
- With --inference-pool, for a router in front of several replicas (the Gateway API Inference Extension):
  inferencepool.yaml (an InferencePool of the deployment's pods, traffic to the front's port, its endpoint picker
  named `<name>-epp`) and endpoint-picker.yaml (the picker's EndpointPickerConfig naming the queue and KV-cache
  metrics trtspec exports under vLLM's names, trtspec.field_metrics); the NetworkPolicy then admits the picker's
  pods to the metrics port, which the picker reads by queue depth and KV-cache use.
- For the prometheus-operator: servicemonitor.yaml (scrape the metrics port every 15 s), prometheusrule.yaml (the
  rules of trtspec.deploy.monitoring), grafana-dashboard.yaml (the dashboard as a ConfigMap labelled
  grafana_dashboard: "1", as Grafana's dashboard sidecar finds them) and prometheus-adapter.yaml (the adapter rule
  that serves the HPA's queue metric as a pods metric).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import yaml

from trtspec import field_metrics, keys
from trtspec.errors import TrtspecError

HTTP_PORT, GRPC_PORT, METRICS_PORT = 8000, 8001, 8002
FRONT_PORT = 9000
FRONT_PORT_NAME, METRICS_PORT_NAME = "openai", "metrics"
HEALTH_PATH = "/health"  # the front's: 200 when the BLS and its target are ready on Triton, 503 otherwise
# the front's: 503 when the pod should be restarted (its target failed every call for a minute, or its models stayed
# unready for longer than loading them takes: trtspec.openai_api.liveness)
LIVE_PATH = "/health/live"
QUEUE_METRIC = "nv_inference_pending_request_count"
# The Gateway API Inference Extension (kubernetes-sigs/gateway-api-inference-extension v1.6.0, the InferencePool CRD
# config/crd/bases/inference.networking.k8s.io_inferencepools.yaml; the picker's config types v1.5.0
# apix/config/v1alpha1/endpointpickerconfig_types.go). 9002: the picker's ext-proc port (the CRD's default for a
# Service reference, and the chart's extProcPort).
POOL_API = "inference.networking.k8s.io/v1"
PICKER_CONFIG_API = "inference.networking.x-k8s.io/v1alpha1"
PICKER_PORT = 9002
PICKER_CONFIG_FILE = "endpoint-picker-config.yaml"
# the label GAIE's chart gives the picker's pods (epplib/templates/_helpers.tpl, selectorLabels, pool mode)
PICKER_POD_LABEL = "inferencepool"

# NVIDIA's Triton images create the user `triton-server` with uid and gid 1000 (triton-inference-server/server
# build.py at v2.71.0, lines 1308-1320: `useradd`, then checks `id -u` and `id -g` are 1000), and Triton's deploy
# guide names it for running as non-root (docs/customization_guide/deploy.md, "Run as a Non-Root User"). It has no
# home directory: HOME points at an emptyDir.
RUN_AS = 1000
HOME = "/home/triton-server"
# The Secret holding the keys (trtspec.keys): its keys and the environment variables `trtspec serve` reads them from.
SECRET_KEYS = {keys.API_ENV: "api-key", keys.ADMIN_ENV: "admin-key"}
# Who may scrape the metrics port: a namespace by its name label (set by Kubernetes on every namespace since 1.22).
MONITORING_NAMESPACE = {"kubernetes.io/metadata.name": "monitoring"}

GIB = 2**30
SHM_GIB = 16  # /dev/shm: the Python-backend models exchange tensors (logits included) through it
SCRATCH_GIB = {"tmp": 4, "home": 2}  # /tmp (mpirun's session directory, the server log) and $HOME (caches, state)
# Host memory beside the engines: tritonserver, the Python-backend stubs of the BLS and the tokenizers, the OpenAI
# front and `trtspec serve` itself. Measured 1.3 GiB RSS for the demo pair on CPU (serve and the front 0.33 GiB,
# tritonserver 0.04, each of the three stubs 0.31), rounded up.
BASE_HOST_GIB = 2
# trtllm: TensorRT-LLM streams an engine file from disk into GPU memory (tllmRuntime.cpp, TllmRuntime's
# RawEngine::Type::FilePath case reads it through an IStreamReader), so weights never sit in host memory whole; each
# engine rank's process holds its CUDA context, the TensorRT/TensorRT-LLM libraries and host buffers. An estimate,
# not measured here.
TRTLLM_RANK_HOST_GIB = 4
# torch: the embedded engine holds its weights as the engine dir stores them, its KV caches up to engine.kv_cache_mb,
# and the torch runtime of its own stub process (measured 0.5-0.6 GiB beyond the weights for the demo pair).
TORCH_ENGINE_HOST_GIB = 1
# CPU cores (request, limit). Starting points, not measurements: the embedded engine computes on the CPU (its OpenMP
# team is sized to the request); a trtllm deployment needs cores for the tokenizers, the BLS and each rank's process.
TORCH_CPU = (4, 8)
TRTLLM_CPU_BASE, TRTLLM_CPU_PER_RANK = 4, 2


class _Dumper(yaml.SafeDumper):
    """Plain YAML: the shared label dicts are written out each time, not as anchors."""

    def ignore_aliases(self, data):
        return True


def _text(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    # a ConfigMap's file (the picker's config, the dashboard, the adapter's rules) as a block a reader can read
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


_Dumper.add_representer(str, _text)


def _name(config_name: str) -> str:
    """A DNS-1123 name for the config."""
    name = re.sub(r"[^a-z0-9-]+", "-", config_name.lower()).strip("-")
    return f"trtspec-{name}"[:63].rstrip("-")


def secret_name(name: str) -> str:
    return f"{name}-keys"


class ManifestError(TrtspecError):
    """A deployment the manifests cannot describe; the message says how to lay it out instead."""


def volume_root(paths: list[Path]) -> Path:
    """The folder the engine volume is mounted at: the deepest one holding the repository and every engine dir."""
    root = Path(os.path.commonpath([str(p) for p in paths]))
    # the pod's own mounts must not lie at or under the volume's (a volume inside one of them, e.g. under /tmp, is
    # mounted after it and works)
    taken = [p for p in ("/dev/shm", "/tmp", HOME) if Path(p) == root or Path(p).is_relative_to(root)]
    if taken:
        raise ManifestError(
            f"the repository and the engines ({', '.join(str(p) for p in paths)}) share no folder but {root}, which "
            f"the pod needs for {taken[0]}: keep them under one folder of their own (e.g. /engines/model_repository "
            "and /engines/<name>) and deploy again"
        )
    return root


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def resources(config, engines: dict[str, Path], gpus: int) -> dict:
    """CPU and memory requests and limits (and the GPUs): the memory request is what the deployment holds in host
    memory, the limit adds room for /dev/shm, whose memory-backed emptyDir counts against it."""
    if config.backend == "trtllm":
        ranks = sum(spec.tp_size * spec.pp_size for spec in (config.target, config.draft) if spec is not None)
        host = BASE_HOST_GIB * GIB + ranks * TRTLLM_RANK_HOST_GIB * GIB
        cpu = TRTLLM_CPU_BASE + TRTLLM_CPU_PER_RANK * ranks
        cpus = (cpu, 2 * cpu)
    else:
        per_engine = TORCH_ENGINE_HOST_GIB * GIB + config.engine.kv_cache_mb * 2**20
        host = BASE_HOST_GIB * GIB + sum(_dir_bytes(Path(d)) + per_engine for d in engines.values())
        cpus = TORCH_CPU
    memory = math.ceil(host / GIB)
    out = {
        "requests": {"cpu": str(cpus[0]), "memory": f"{memory}Gi"},
        "limits": {"cpu": str(cpus[1]), "memory": f"{memory + SHM_GIB}Gi"},
    }
    if gpus:
        out["requests"]["nvidia.com/gpu"] = out["limits"]["nvidia.com/gpu"] = gpus
    return out


def _security_context() -> dict:
    # The Pod Security Standards' "restricted" profile. Nothing trtspec runs needs root: tritonserver, the Python and
    # tensorrtllm backends and mpirun run as this user (trtspec passes mpirun --allow-run-as-root only as root), the
    # GPUs come through the device plugin, and everything written goes to the emptyDirs below.
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _env(name: str, config, mpi: bool) -> list[dict]:
    env = [
        {"name": var, "valueFrom": {"secretKeyRef": {"name": secret_name(name), "key": key}}}
        for var, key in SECRET_KEYS.items()
    ]
    env += [
        {"name": "HOME", "value": HOME},
        {"name": "XDG_CACHE_HOME", "value": f"{HOME}/.cache"},  # trtspec's backend cache, Hugging Face's, CUDA's
        {"name": "XDG_STATE_HOME", "value": f"{HOME}/.local/state"},  # keys trtspec generates (none with the Secret)
        {"name": "TMPDIR", "value": "/tmp"},
        # tokenizers load from the engine volume; never from the Hugging Face Hub at serve time
        {"name": "HF_HUB_OFFLINE", "value": "1"},
    ]
    if config.backend == "torch":
        # the embedded engines' OpenMP teams sized to the cores requested, not to the node's
        env.append(
            {"name": "OMP_NUM_THREADS", "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1"}}}
        )
    if mpi:
        # OpenMPI's shared-memory transport would copy between ranks with process_vm_readv (cross-memory attach),
        # which needs CAP_SYS_PTRACE, dropped here: copy through the shared segment instead
        env.append({"name": "OMPI_MCA_btl_vader_single_copy_mechanism", "value": "none"})
    return env


def picker_name(name: str) -> str:
    return f"{name}-epp"


def picker_args(name: str) -> list[str]:
    """What the endpoint picker runs with for this pool: its config (endpoint-picker.yaml, mounted at /config) and
    the port the deployment's metrics are on, which is not the pool's target port."""
    return [
        f"--pool-name={name}",
        f"--config-file=/config/{PICKER_CONFIG_FILE}",
        f"--{field_metrics.PICKER_METRICS_PORT_FLAG}={METRICS_PORT}",
    ]


def picker_config() -> dict:
    """The endpoint picker's EndpointPickerConfig: score by queue depth and KV-cache use, read from trtspec's
    metrics under vLLM's names (an engine entry of their own, the pods' default, so nothing else is asked for)."""
    engine = {
        "name": field_metrics.PICKER_ENGINE,
        "queuedRequestsSpec": field_metrics.REQUESTS_WAITING,
        "runningRequestsSpec": field_metrics.REQUESTS_RUNNING,
        "kvUsageSpec": field_metrics.KV_CACHE_USAGE,
        "loraSpec": "",  # trtspec serves no LoRA adapters
        "cacheInfoSpec": "",
    }
    return {
        "apiVersion": PICKER_CONFIG_API,
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "max-score-picker"},
            {"type": "metrics-data-source", "parameters": {"scheme": "http", "path": "/metrics"}},
            {
                "type": "core-metrics-extractor",
                "parameters": {"defaultEngine": field_metrics.PICKER_ENGINE, "engineConfigs": [engine]},
            },
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "queue-scorer"},
                    {"pluginRef": "kv-cache-utilization-scorer"},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
        "dataLayer": {
            "sources": [{"pluginRef": "metrics-data-source", "extractors": [{"pluginRef": "core-metrics-extractor"}]}]
        },
    }


def inference_pool(name: str, labels: dict[str, str]) -> dict[str, dict]:
    """The InferencePool of the deployment's pods and its endpoint picker's settings."""
    pool = {
        "apiVersion": POOL_API,
        "kind": "InferencePool",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "selector": {"matchLabels": labels},
            "targetPorts": [{"number": FRONT_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": picker_name(name),
                "port": {"number": PICKER_PORT},
                "failureMode": "FailClose",
            },
        },
    }
    settings = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": picker_name(name), "labels": labels},
        "data": {PICKER_CONFIG_FILE: yaml.dump(picker_config(), Dumper=_Dumper, sort_keys=False)},
    }
    return {"inferencepool.yaml": pool, "endpoint-picker.yaml": settings}


def manifests(loaded, repo: Path, *, image: str, pvc: str, inference_pool_too: bool = False) -> dict[str, dict]:
    from trtspec.deploy.launch import Launch
    from trtspec.deploy.monitoring import dashboard, rules
    from trtspec.marker import MARKER_FILE
    from trtspec.server import start_timeout_for

    config = loaded.config
    repo = Path(repo).resolve()
    marker = json.loads((repo / MARKER_FILE).read_text())
    engines = {role: Path(p) for role, p in (marker.get("engines") or {}).items()}
    launch = Launch.from_dict(marker.get("launch"))
    gpus = max(launch.gpus, 1) if config.backend == "trtllm" else 0
    root = volume_root([repo, *engines.values()])
    name = _name(config.name)
    labels = {"app.kubernetes.io/name": "trtspec", "app.kubernetes.io/instance": name}
    probe = {"httpGet": {"path": HEALTH_PATH, "port": FRONT_PORT_NAME}}
    wait = start_timeout_for(repo)
    container = {
        "name": "tritonserver",
        "image": image,
        "args": [
            "serve",
            "--repo",
            str(repo),
            "--host",
            "127.0.0.1",
            "--metrics-host",
            "0.0.0.0",
            "--metrics-port",
            str(METRICS_PORT),
            "--openai-host",
            "0.0.0.0",
            "--openai-port",
            str(FRONT_PORT),
        ],
        "ports": [
            {"name": FRONT_PORT_NAME, "containerPort": FRONT_PORT, "protocol": "TCP"},
            {"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "env": _env(name, config, launch.mpi),
        "resources": resources(config, engines, gpus),
        "securityContext": _security_context(),
        "volumeMounts": [
            {"name": "engines", "mountPath": str(root), "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "home", "mountPath": HOME},
        ],
        # at least as long as `trtspec serve` itself waits for the models (trtspec.server.start_timeout_for)
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": max(180, math.ceil(wait / 10) + 6)},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3},
        # Restarts a pod that cannot mend itself: its target fails every call (TensorRT-LLM's executor keeps its model
        # READY when it does), or its models stay unready for longer than loading them takes (the BLS reloads a dead
        # embedded engine model; under mpirun nothing can). The front keeps those times; a minute of 503s restarts.
        "livenessProbe": {
            "httpGet": {"path": LIVE_PATH, "port": FRONT_PORT_NAME},
            "periodSeconds": 15,
            "timeoutSeconds": 10,
            "failureThreshold": 4,
        },
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(METRICS_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    # the server talks to no Kubernetes API: no token in the pod to steal
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": RUN_AS,
                        "runAsGroup": RUN_AS,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "volumes": [
                        {"name": "engines", "persistentVolumeClaim": {"claimName": pvc, "readOnly": True}},
                        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{SHM_GIB}Gi"}},
                        *(
                            {"name": volume, "emptyDir": {"sizeLimit": f"{size}Gi"}}
                            for volume, size in SCRATCH_GIB.items()
                        ),
                    ],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "selector": labels,
            "ports": [
                {"name": FRONT_PORT_NAME, "port": FRONT_PORT, "targetPort": FRONT_PORT_NAME, "protocol": "TCP"},
                {"name": METRICS_PORT_NAME, "port": METRICS_PORT, "targetPort": METRICS_PORT_NAME, "protocol": "TCP"},
            ],
        },
    }
    network_policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "podSelector": {"matchLabels": labels},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"port": FRONT_PORT, "protocol": "TCP"}]},
                {
                    "from": [{"namespaceSelector": {"matchLabels": MONITORING_NAMESPACE}}],
                    "ports": [{"port": METRICS_PORT, "protocol": "TCP"}],
                },
            ],
        },
    }
    if inference_pool_too:  # the endpoint picker reads the queue and KV-cache gauges from the metrics port
        network_policy["spec"]["ingress"].append(
            {
                "from": [{"podSelector": {"matchLabels": {PICKER_POD_LABEL: picker_name(name)}}}],
                "ports": [{"port": METRICS_PORT, "protocol": "TCP"}],
            }
        )
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": 1,
            "maxReplicas": 4,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": QUEUE_METRIC, "selector": {"matchLabels": {"model": "tensorrt_llm_bls"}}},
                        "target": {"type": "AverageValue", "averageValue": str(config.engine.max_batch_size)},
                    },
                }
            ],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}},
        },
    }
    service_monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "selector": {"matchLabels": labels},
            "endpoints": [{"port": METRICS_PORT_NAME, "interval": "15s", "path": "/metrics"}],
        },
    }
    prometheus_rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": name, "labels": labels},
        "spec": rules(),
    }
    dashboard_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-dashboard", "labels": labels | {"grafana_dashboard": "1"}},
        "data": {"trtspec.json": json.dumps(dashboard(), indent=2)},
    }
    adapter_rule = {
        "seriesQuery": f'{QUEUE_METRIC}{{namespace!="",pod!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
        "name": {"matches": QUEUE_METRIC, "as": QUEUE_METRIC},
        "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
    }
    adapter = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-adapter-rules", "labels": labels},
        "data": {"config.yaml": yaml.safe_dump({"rules": [adapter_rule]}, sort_keys=False)},
    }
    return {
        "deployment.yaml": deployment,
        "service.yaml": service,
        "networkpolicy.yaml": network_policy,
        "hpa.yaml": hpa,
        "servicemonitor.yaml": service_monitor,
        "prometheusrule.yaml": prometheus_rule,
        "grafana-dashboard.yaml": dashboard_map,
        "prometheus-adapter.yaml": adapter,
    } | (inference_pool(name, labels) if inference_pool_too else {})


_HEADERS = {
    "hpa.yaml": f"# Example autoscaler on Triton's queue gauge {QUEUE_METRIC} (requests waiting in the BLS model).\n"
    "# Needs a custom-metrics adapter (e.g. Prometheus Adapter) exposing it as a pods metric.\n",
    "servicemonitor.yaml": "# prometheus-operator: scrape the deployment's metrics port.\n",
    "prometheusrule.yaml": (
        "# prometheus-operator: trtspec's recording and alerting rules (trtspec/deploy/monitoring.py).\n"
    ),
    "grafana-dashboard.yaml": "# The trtspec dashboard, for Grafana's dashboard sidecar (label grafana_dashboard).\n",
    "prometheus-adapter.yaml": f"# Prometheus Adapter rule serving {QUEUE_METRIC} as a pods metric for hpa.yaml; "
    "merge its\n"
    "# config.yaml into the adapter's own config (its `rules`).\n",
}


def _headers(name: str) -> dict[str, str]:
    secret = secret_name(name)
    picker = picker_name(name)
    args = " ".join(picker_args(name))
    return _HEADERS | {
        "inferencepool.yaml": f"""\
# Gateway API Inference Extension: the deployment's pods as one InferencePool. A Gateway's HTTPRoute sends requests
# to it (backendRef kind InferencePool, group inference.networking.k8s.io); its endpoint picker, the Service {picker}
# (port {PICKER_PORT}), picks the replica for each request by queue depth and KV-cache use. Needs the CRD
# (GAIE's config/crd/bases/inference.networking.k8s.io_inferencepools.yaml, v1.0 or later) and a picker, deployed
# as GAIE's chart or your platform deploys it, running with endpoint-picker.yaml:
#   {args}
""",
        "endpoint-picker.yaml": f"""\
# The endpoint picker's settings for the InferencePool: mount this ConfigMap at /config in the picker's pod and run
# it with
#   {args}
# trtspec exports the queue and KV-cache gauges under vLLM's names (docs/metrics.md), the picker's defaults, on the
# metrics port {METRICS_PORT}: the pool's target port is the OpenAI front ({FRONT_PORT}), hence the metrics-port flag.
# Label the picker's pods {PICKER_POD_LABEL}: {picker} (as GAIE's chart does for a release named {name}) for the
# NetworkPolicy to admit them to that port.
""",
        "deployment.yaml": f"""\
# trtspec serve on the model repository; the engine volume must hold the repository and the engines at the paths
# `trtspec deploy` wrote (it is mounted, read-only, at their common folder; its files readable by uid {RUN_AS}).
#
# Triton's HTTP/gRPC APIs listen on the pod's loopback only. The OpenAI front (port {FRONT_PORT}) is the public
# surface: every route but {HEALTH_PATH} needs `Authorization: Bearer <api key>`. Metrics ({METRICS_PORT}) are
# unauthenticated and the NetworkPolicy admits only the monitoring namespace to them.
#
# The keys come from the Secret {secret} (keys api-key, admin-key; {keys.MIN_LENGTH} characters or more each), which
# this file never holds. Create it before applying, from files that never enter version control:
#   python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > api-key
#   python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > admin-key
#   kubectl create secret generic {secret} --from-file=api-key=./api-key --from-file=admin-key=./admin-key
# Without it the pod does not start (CreateContainerConfigError). The admin key opens Triton's model-repository,
# model-config, shared-memory, statistics, trace and logging APIs (header {keys.ADMIN_HEADER}), which are reachable
# only from inside the pod:
#   kubectl port-forward deploy/{name} 8000:8000 &
#   curl -s -X POST -H "{keys.ADMIN_HEADER}: $(cat admin-key)" localhost:8000/v2/repository/index
#
# Resources: memory is what the deployment holds in host memory (an estimate from the engines and
# engine.kv_cache_mb, see trtspec/deploy/k8s.py); the limit adds the /dev/shm emptyDir's {SHM_GIB}Gi, which counts
# against it. CPU figures are starting points: measure and adjust.
""",
        "service.yaml": f"# The OpenAI front ({FRONT_PORT}) and Prometheus metrics ({METRICS_PORT}) of the deployment; "
        "Triton's own\n# HTTP/gRPC listen on the pod's loopback and are not exposed.\n",
        "networkpolicy.yaml": f"""\
# Ingress to the deployment's pods: the OpenAI front ({FRONT_PORT}) from anywhere (narrow it with a `from` naming your
# gateway's namespace or pods), the metrics port ({METRICS_PORT}) only from the namespace named monitoring: change
# the namespaceSelector to where your Prometheus runs. Anything else is refused (with a CNI that enforces
# NetworkPolicy).
""",
    }


def write_manifests(
    loaded, repo: Path, out_dir: str | Path, *, image: str, pvc: str, inference_pool_too: bool = False
) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    headers = _headers(_name(loaded.config.name))
    written = []
    for filename, doc in manifests(loaded, repo, image=image, pvc=pvc, inference_pool_too=inference_pool_too).items():
        path = out / filename
        path.write_text(
            f"# Written by `trtspec deploy --k8s` for {loaded.config.name}.\n{headers[filename]}"
            + yaml.dump(doc, Dumper=_Dumper, sort_keys=False)
        )
        written.append(path)
    return written
