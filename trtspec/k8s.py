"""Kubernetes manifests for a deployed repository: `trtspec deploy -c CONFIG --repo R --k8s OUT`.

- deployment.yaml: one pod running `trtspec serve` (the image of docker/Dockerfile) on the repository, with the GPUs the
  placement uses, the engine volume (a PersistentVolumeClaim holding the engines and the repository at the paths
  `trtspec deploy` wrote into the configs), /dev/shm for the Python backend, probes on /v2/health/ready (a startup
  probe gives engine loading at least 30 minutes, more for engines `trtspec serve` waits longer for; the liveness
  probe restarts a pod whose models stay unready for longer than loading them takes) and Prometheus scrape
  annotations for the metrics port 8002.
- service.yaml: HTTP 8000, gRPC 8001, metrics 8002.
- hpa.yaml: an example HorizontalPodAutoscaler on Triton's queue gauge `nv_inference_pending_request_count` of the
  BLS model; it needs a metrics adapter (e.g. Prometheus Adapter) that serves that metric as a pods metric.
- For the prometheus-operator: servicemonitor.yaml (scrape the metrics port every 15 s), prometheusrule.yaml (the
  rules of trtspec.monitoring), grafana-dashboard.yaml (the dashboard as a ConfigMap labelled grafana_dashboard: "1",
  as Grafana's dashboard sidecar finds them) and prometheus-adapter.yaml (the adapter rule that serves the HPA's
  queue metric as a pods metric).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import yaml

HTTP_PORT, GRPC_PORT, METRICS_PORT = 8000, 8001, 8002


class _Dumper(yaml.SafeDumper):
    """Plain YAML: the shared label dicts are written out each time, not as anchors."""

    def ignore_aliases(self, data):
        return True


READY_PATH = "/v2/health/ready"
QUEUE_METRIC = "nv_inference_pending_request_count"


def _name(config_name: str) -> str:
    """A DNS-1123 name for the config."""
    name = re.sub(r"[^a-z0-9-]+", "-", config_name.lower()).strip("-")
    return f"trtspec-{name}"[:63].rstrip("-")


def volume_root(paths: list[Path]) -> Path:
    """The folder the engine volume is mounted at: the deepest one holding the repository and every engine dir."""
    return Path(os.path.commonpath([str(p) for p in paths]))


def manifests(loaded, repo: Path, *, image: str, pvc: str) -> dict[str, dict]:
    from trtspec.launch import Launch
    from trtspec.marker import MARKER_FILE
    from trtspec.monitoring import dashboard, rules
    from trtspec.server import start_timeout_for

    config = loaded.config
    repo = Path(repo).resolve()
    marker = json.loads((repo / MARKER_FILE).read_text())
    engines = [Path(p) for p in (marker.get("engines") or {}).values()]
    launch = Launch.from_dict(marker.get("launch"))
    gpus = max(launch.gpus, 1) if config.backend == "trtllm" else 0
    root = volume_root([repo, *engines])
    name = _name(config.name)
    labels = {"app.kubernetes.io/name": "trtspec", "app.kubernetes.io/instance": name}
    probe = {"httpGet": {"path": READY_PATH, "port": "http"}}
    container = {
        "name": "tritonserver",
        "image": image,
        "args": [
            "serve",
            "--repo",
            str(repo),
            "--host",
            "0.0.0.0",
            "--http-port",
            str(HTTP_PORT),
            "--grpc-port",
            str(GRPC_PORT),
            "--metrics-port",
            str(METRICS_PORT),
        ],
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT},
            {"name": "grpc", "containerPort": GRPC_PORT},
            {"name": "metrics", "containerPort": METRICS_PORT},
        ],
        "volumeMounts": [
            {"name": "engines", "mountPath": str(root), "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
        # at least as long as `trtspec serve` itself waits for the models (trtspec.server.start_timeout_for)
        "startupProbe": {
            **probe,
            "periodSeconds": 10,
            "failureThreshold": max(180, math.ceil(start_timeout_for(repo) / 10) + 6),
        },
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3},
        # Restarts a pod whose models cannot come back: not ready for longer than loading them takes (the BLS
        # reloads an engine model whose process died, retrying; under mpirun nothing can, and this probe restarts it)
        "livenessProbe": {
            **probe,
            "periodSeconds": 15,
            "timeoutSeconds": 5,
            "failureThreshold": max(4, math.ceil(start_timeout_for(repo) / 15) + 2),
        },
    }
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}}
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
                    "containers": [container],
                    "volumes": [
                        {"name": "engines", "persistentVolumeClaim": {"claimName": pvc, "readOnly": True}},
                        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
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
                {"name": "http", "port": HTTP_PORT, "targetPort": "http"},
                {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc"},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"},
            ],
        },
    }
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
            "endpoints": [{"port": "metrics", "interval": "15s", "path": "/metrics"}],
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
        "hpa.yaml": hpa,
        "servicemonitor.yaml": service_monitor,
        "prometheusrule.yaml": prometheus_rule,
        "grafana-dashboard.yaml": dashboard_map,
        "prometheus-adapter.yaml": adapter,
    }


_HEADERS = {
    "deployment.yaml": "# trtspec serve on the model repository; the engine volume must hold the repository and the "
    "engines\n"
    "# at the paths `trtspec deploy` wrote (it is mounted at their common folder).\n",
    "service.yaml": "# HTTP (KServe v2 + generate), gRPC and Prometheus metrics of the deployment.\n",
    "hpa.yaml": f"# Example autoscaler on Triton's queue gauge {QUEUE_METRIC} (requests waiting in the BLS model).\n"
    "# Needs a custom-metrics adapter (e.g. Prometheus Adapter) exposing it as a pods metric.\n",
    "servicemonitor.yaml": "# prometheus-operator: scrape the deployment's metrics port.\n",
    "prometheusrule.yaml": "# prometheus-operator: trtspec's recording and alerting rules (trtspec/monitoring.py).\n",
    "grafana-dashboard.yaml": "# The trtspec dashboard, for Grafana's dashboard sidecar (label grafana_dashboard).\n",
    "prometheus-adapter.yaml": f"# Prometheus Adapter rule serving {QUEUE_METRIC} as a pods metric for hpa.yaml; "
    "merge its\n"
    "# config.yaml into the adapter's own config (its `rules`).\n",
}


def write_manifests(loaded, repo: Path, out_dir: str | Path, *, image: str, pvc: str) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, doc in manifests(loaded, repo, image=image, pvc=pvc).items():
        path = out / filename
        path.write_text(
            f"# Written by `trtspec deploy --k8s` for {loaded.config.name}.\n{_HEADERS[filename]}"
            + yaml.dump(doc, Dumper=_Dumper, sort_keys=False)
        )
        written.append(path)
    return written
