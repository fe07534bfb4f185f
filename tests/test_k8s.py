"""The Kubernetes manifests `trtspec deploy --k8s` writes, read as a platform team's admission would: the Pod Security
Standards' "restricted" profile for every pod and container, no service-account token, no secret value in any file,
a NetworkPolicy that admits only the front and (from the monitoring namespace) the metrics, Triton's own APIs kept on
the pod's loopback, resources for every container, and every flag the manifests and the image pass to `trtspec
serve` one that exists. The schema check of every kind is in test_trtllm_deploy.py."""

from __future__ import annotations

import copy
import ipaddress
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from conftest import free_ports
from test_trtllm_deploy import deployed, no_trtllm  # noqa: F401  (fixtures: the 70B example on layout engines)

from trtspec import keys
from trtspec.cli import cli
from trtspec.config import load_config
from trtspec.deploy import k8s
from trtspec.deploy.k8s import (
    FRONT_PORT,
    HEALTH_PATH,
    LIVE_PATH,
    METRICS_PORT,
    MONITORING_NAMESPACE,
    SHM_GIB,
    manifests,
    secret_name,
    write_manifests,
)

ROOT = Path(__file__).resolve().parents[1]

# ---- the Pod Security Standards' "restricted" profile (kubernetes.io/docs/concepts/security/pod-security-standards,
# the baseline controls it includes and its own) -----------------------------------------------------------------

RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def restricted_violations(pod: dict) -> list[str]:
    """Every way a pod spec breaks the restricted profile, one line each (empty: it passes)."""
    problems = []
    pod_sc = pod.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            problems.append(f"spec.{field} is true")
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            problems.append(f"volume {volume['name']}: type {sorted(kinds - RESTRICTED_VOLUMES)} is not allowed")
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            problems.append(f"sysctl {sysctl['name']} is not a safe sysctl")
    if pod_sc.get("runAsUser") == 0:
        problems.append("spec.securityContext.runAsUser is 0")
    problems += _selinux_apparmor("spec.securityContext", pod_sc)
    if (pod_sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        problems.append("spec.securityContext.seccompProfile is Unconfined")
    containers = [
        (kind, c) for kind in ("initContainers", "containers", "ephemeralContainers") for c in pod.get(kind) or []
    ]
    for kind, container in containers:
        where = f"{kind} {container['name']}"
        sc = container.get("securityContext") or {}
        if sc.get("privileged"):
            problems.append(f"{where}: privileged")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            problems.append(f"{where}: windowsOptions.hostProcess")
        if any(port.get("hostPort") for port in container.get("ports") or []):
            problems.append(f"{where}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            problems.append(f"{where}: procMount {sc['procMount']}")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}: allowPrivilegeEscalation is not false")
        non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        if non_root is not True:
            problems.append(f"{where}: runAsNonRoot is not true (pod or container)")
        if sc.get("runAsUser") == 0:
            problems.append(f"{where}: runAsUser is 0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{where}: seccompProfile is {seccomp!r}, not RuntimeDefault or Localhost")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            problems.append(f"{where}: capabilities.drop lacks ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{where}: capabilities.add {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
        problems += _selinux_apparmor(where, sc)
    return problems


def _selinux_apparmor(where: str, sc: dict) -> list[str]:
    problems = []
    selinux = sc.get("seLinuxOptions") or {}
    if selinux.get("type") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        problems.append(f"{where}: seLinuxOptions {selinux}")
    if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
        problems.append(f"{where}: appArmorProfile is Unconfined")
    return problems


def pod_specs(docs: dict[str, dict]) -> list[dict]:
    return [doc["spec"]["template"]["spec"] for doc in docs.values() if doc["kind"] in ("Deployment", "StatefulSet")]


# ---- the manifests -------------------------------------------------------------------------------------------


def write(config: Path, repo: Path, out: Path) -> dict[str, dict]:
    write_manifests(load_config(config), repo, out, image="registry.example/trtspec:0.1.0", pvc="engines")
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(out.glob("*.yaml"))}


@pytest.fixture
def trtllm_docs(deployed, tmp_path):  # noqa: F811
    config, engines, repo = deployed
    result = CliRunner().invoke(cli, ["deploy", "-c", str(config), "--engines", str(engines), "--repo", str(repo)])
    assert result.exit_code == 0, result.output
    return write(config, repo, tmp_path / "k8s")


@pytest.fixture
def torch_docs(built_fp8, model_repository, tmp_path):
    return write(built_fp8.config, model_repository, tmp_path / "k8s")


@pytest.fixture(params=["trtllm", "torch"])
def docs(request):
    return request.getfixturevalue(f"{request.param}_docs")


def the_container(docs: dict[str, dict]) -> dict:
    (container,) = docs["deployment.yaml"]["spec"]["template"]["spec"]["containers"]
    return container


def test_both_backends_manifests_validate_strictly(docs):
    import kubernetes_validate

    for doc in docs.values():
        if not doc["apiVersion"].startswith("monitoring.coreos.com/"):  # those: test_trtllm_deploy.py
            kubernetes_validate.validate(doc, "1.30.0", strict=True)


def test_every_pod_and_container_meets_the_restricted_profile(docs):
    (pod,) = pod_specs(docs)
    assert restricted_violations(pod) == []
    # and more than the profile asks: no token, no service links, a read-only root filesystem
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["runAsGroup"] == 1000
    assert all(c["securityContext"]["readOnlyRootFilesystem"] is True for c in pod["containers"])


def test_the_restricted_check_finds_each_breach(torch_docs):
    """Each rule of the checker above, broken one at a time on the generated pod, is found (so a passing pod
    passes because it meets the rule, not because the checker looks elsewhere)."""
    (good,) = pod_specs(torch_docs)

    def broken(edit) -> list[str]:
        pod = copy.deepcopy(good)
        edit(pod, pod["containers"][0].setdefault("securityContext", {}))
        return restricted_violations(pod)

    breaches = {
        "hostNetwork": lambda p, c: p.update(hostNetwork=True),
        "hostPID": lambda p, c: p.update(hostPID=True),
        "hostPath": lambda p, c: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
        "privileged": lambda p, c: c.update(privileged=True),
        "allowPrivilegeEscalation": lambda p, c: c.pop("allowPrivilegeEscalation"),
        "runAsNonRoot": lambda p, c: (c.pop("runAsNonRoot"), p["securityContext"].pop("runAsNonRoot")),
        "runAsUser is 0": lambda p, c: c.update(runAsUser=0),
        "seccompProfile": lambda p, c: (c.pop("seccompProfile"), p["securityContext"].pop("seccompProfile")),
        "Unconfined": lambda p, c: p["securityContext"].update(seccompProfile={"type": "Unconfined"}),
        "capabilities.drop": lambda p, c: c.update(capabilities={"drop": ["NET_RAW"]}),
        "capabilities.add": lambda p, c: c["capabilities"].update(add=["SYS_PTRACE"]),
        "hostPort": lambda p, c: p["containers"][0]["ports"][0].update(hostPort=9000),
        "procMount": lambda p, c: c.update(procMount="Unmasked"),
        "sysctl": lambda p, c: p["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
    }
    for rule, edit in breaches.items():
        found = broken(edit)
        assert len(found) >= 1 and any(rule in line for line in found), (rule, found)
    # container-level settings stand in for the pod's
    assert broken(lambda p, c: p.pop("securityContext")) == []


def test_triton_stays_on_loopback_and_the_front_is_the_public_surface(docs):
    container = the_container(docs)
    args = container["args"]
    flags = dict(zip(args[1::2], args[2::2]))
    assert args[0] == "serve"
    assert flags["--host"] == "127.0.0.1"  # Triton's HTTP and gRPC
    assert flags["--openai-host"] == "0.0.0.0" and flags["--openai-port"] == str(FRONT_PORT)
    assert flags["--metrics-host"] == "0.0.0.0" and flags["--metrics-port"] == str(METRICS_PORT)
    assert not {"--api-key", "--admin-key", "--http-port", "--grpc-port"} & set(flags)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"openai": FRONT_PORT, "metrics": METRICS_PORT}  # 8000/8001 listen on loopback: not declared
    service = docs["service.yaml"]["spec"]["ports"]
    assert {(p["port"], p["targetPort"]) for p in service} == {(FRONT_PORT, "openai"), (METRICS_PORT, "metrics")}
    # probes: the front's unauthenticated /health (Triton's /v2/health/ready is on loopback, where kubelet can't go)
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": HEALTH_PATH, "port": "openai"}, probe
    assert container["livenessProbe"]["httpGet"] == {"path": LIVE_PATH, "port": "openai"}
    # what the monitoring stack names lines up with the pod
    monitor = docs["servicemonitor.yaml"]["spec"]
    assert monitor["endpoints"][0]["port"] in {p["name"] for p in service}
    assert monitor["selector"]["matchLabels"] == docs["service.yaml"]["metadata"]["labels"]
    template = docs["deployment.yaml"]["spec"]["template"]
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
    assert docs["hpa.yaml"]["spec"]["scaleTargetRef"]["name"] == docs["deployment.yaml"]["metadata"]["name"]


def test_the_network_policy_admits_the_front_and_only_monitoring_to_the_metrics(docs):
    policy = docs["networkpolicy.yaml"]
    container_ports = {p["containerPort"] for p in the_container(docs)["ports"]}
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == docs["deployment.yaml"]["spec"]["template"]["metadata"]["labels"]
    assert spec["policyTypes"] == ["Ingress"]
    admitted = {}  # port -> the peers admitted to it (None: anyone)
    for rule in spec["ingress"]:
        assert rule.get("ports"), "a rule without ports admits every port"
        for port in rule["ports"]:
            assert port["protocol"] == "TCP" and port["port"] in container_ports
            admitted[port["port"]] = rule.get("from")
    assert admitted[FRONT_PORT] is None
    assert admitted[METRICS_PORT] == [{"namespaceSelector": {"matchLabels": MONITORING_NAMESPACE}}]
    assert set(admitted) == {FRONT_PORT, METRICS_PORT}  # Triton's 8000/8001 from nowhere


def test_no_secret_value_in_any_manifest(deployed, tmp_path, monkeypatch):  # noqa: F811
    """The keys are read from the Secret by name; whatever keys the machine that writes the manifests holds (in its
    environment or generated into its state directory) never lands in a file."""
    config, engines, repo = deployed
    planted = {name: secrets.token_urlsafe(24) for name in (keys.API_ENV, keys.ADMIN_ENV, keys.CONTROL_ENV_TOKEN)}
    for name, value in planted.items():
        monkeypatch.setenv(name, value)
    # and a key generated where `trtspec serve` would generate the repository's admin key
    generated = keys.resolve(
        file=None, option="-", env="TRTSPEC_UNSET", generate_into=keys.state_dir(repo) / "admin-key"
    )
    out = tmp_path / "k8s"
    result = CliRunner().invoke(
        cli, ["deploy", "-c", str(config), "--engines", str(engines), "--repo", str(repo), "--k8s", str(out)]
    )
    assert result.exit_code == 0, result.output
    texts = {p.name: p.read_text() for p in out.glob("*.yaml")}
    for value in [*planted.values(), generated.value]:
        assert not any(value in text for text in texts.values())
    docs = {name: yaml.safe_load(text) for name, text in texts.items()}
    assert "Secret" not in {doc["kind"] for doc in docs.values()}
    env = {e["name"]: e for e in the_container(docs)["env"]}
    name = docs["deployment.yaml"]["metadata"]["name"]
    assert env[keys.API_ENV] == {
        "name": keys.API_ENV,
        "valueFrom": {"secretKeyRef": {"name": secret_name(name), "key": "api-key"}},
    }
    assert env[keys.ADMIN_ENV]["valueFrom"]["secretKeyRef"] == {"name": f"{name}-keys", "key": "admin-key"}
    secretish = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.I)
    for var in env.values():
        if secretish.search(var["name"]):
            assert "value" not in var and "secretKeyRef" in var["valueFrom"], var
    # how to create the Secret is said where the Deployment is
    assert f"kubectl create secret generic {name}-keys --from-file=api-key=" in texts["deployment.yaml"]


def test_what_is_written_goes_to_an_empty_dir_of_bounded_size(docs):
    pod = docs["deployment.yaml"]["spec"]["template"]["spec"]
    container = the_container(docs)
    empty = {v["name"]: v["emptyDir"] for v in pod["volumes"] if "emptyDir" in v}
    assert empty and all(v.get("sizeLimit") for v in empty.values())
    assert empty["dshm"] == {"medium": "Memory", "sizeLimit": f"{SHM_GIB}Gi"}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/dev/shm"]["name"] == "dshm"
    writable = [path for path, m in mounts.items() if m["name"] in empty]
    env = {e["name"]: e.get("value") for e in container["env"]}
    # the root filesystem is read-only: everything trtspec, Triton, mpirun and the caches write lies on an emptyDir
    for var in ("HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME", "TMPDIR"):
        assert any(env[var] == w or env[var].startswith(w.rstrip("/") + "/") for w in writable), (var, env[var])
    assert "/tmp" in writable
    (engines,) = [m for m in container["volumeMounts"] if m["name"] == "engines"]
    assert engines["readOnly"] is True


def test_resources_are_requested_and_limited(trtllm_docs, torch_docs, built_fp8, tmp_path):
    gpu = the_container(trtllm_docs)["resources"]
    assert gpu["limits"]["nvidia.com/gpu"] == gpu["requests"]["nvidia.com/gpu"] == 4
    for res in (gpu, the_container(torch_docs)["resources"]):
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(res[kind]), res
        request, limit = (int(res[k]["memory"].removesuffix("Gi")) for k in ("requests", "limits"))
        assert limit == request + SHM_GIB  # room for /dev/shm, which counts against the memory limit
        assert int(res["limits"]["cpu"]) >= int(res["requests"]["cpu"]) >= 1
    torch = the_container(torch_docs)["resources"]
    assert "nvidia.com/gpu" not in torch["limits"]
    # the embedded engines' KV budgets (and weights) are host memory: 7 GiB more budget for each of the two engines
    # asks for 14 GiB more
    config = yaml.safe_load(built_fp8.config.read_text())
    assert config.get("engine", {}).get("kv_cache_mb", 1024) == 1024
    config.setdefault("engine", {})["kv_cache_mb"] = 8192
    bigger = tmp_path / "bigger.yaml"
    bigger.write_text(yaml.safe_dump(config))
    repo = Path(the_container(torch_docs)["args"][2])
    more = manifests(load_config(bigger), repo, image="i", pvc="p")["deployment.yaml"]["spec"]["template"]["spec"]
    more = more["containers"][0]["resources"]["requests"]["memory"]
    assert int(more.removesuffix("Gi")) == int(torch["requests"]["memory"].removesuffix("Gi")) + 14
    # the embedded engine's OpenMP team follows the cores requested
    env = {e["name"]: e for e in the_container(torch_docs)["env"]}
    assert env["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]["resource"] == "requests.cpu"


def test_mpi_deployments_copy_without_cross_memory_attach(trtllm_docs, torch_docs):
    """CAP_SYS_PTRACE is dropped, which OpenMPI's single-copy transport needs; only the MPI launch is told so."""
    env = {e["name"]: e.get("value") for e in the_container(trtllm_docs)["env"]}
    assert env["OMPI_MCA_btl_vader_single_copy_mechanism"] == "none"
    assert "OMPI_MCA_btl_vader_single_copy_mechanism" not in {e["name"] for e in the_container(torch_docs)["env"]}


def test_a_volume_over_the_pods_own_mounts_is_refused():
    from trtspec.deploy.k8s import ManifestError, volume_root

    assert volume_root([Path("/engines/model_repository"), Path("/engines/a/target")]) == Path("/engines")
    assert volume_root([Path("/tmp/x/repo"), Path("/tmp/x/target")]) == Path("/tmp/x")  # mounted inside /tmp's
    for paths in (["/engines/repo", "/data/target"], ["/home/a/repo", "/home/b/target"], ["/tmp/repo", "/tmp/t"]):
        with pytest.raises(ManifestError, match="keep them under one folder"):
            volume_root([Path(p) for p in paths])


# ---- the flags the manifests and the image pass exist ----------------------------------------------------------


def serve_flags() -> set[str]:
    """The options `trtspec serve --help` lists (the lines that define them, not flags named in help text)."""
    result = CliRunner().invoke(cli, ["serve", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return set(re.findall(r"^  (?:-\w, )?(--[a-z][a-z0-9-]*)", result.output, re.M))


def dockerfile_cmd() -> list[str]:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    (line,) = [line for line in text.splitlines() if line.startswith("CMD ")]
    return json.loads(line.removeprefix("CMD "))


def test_every_flag_the_manifests_and_the_image_pass_to_serve_exists(torch_docs):
    known = serve_flags()
    for args in (the_container(torch_docs)["args"], dockerfile_cmd()):
        assert args[0] == "serve"
        used = {a for a in args if a.startswith("--")}
        assert used and used <= known, sorted(used - known)
    # the check reads exactly the options serve defines
    assert known - {"--help"} == {opt for p in cli.commands["serve"].params for opt in p.opts if opt.startswith("--")}


def test_the_image_runs_the_same_shape(torch_docs):
    cmd = dockerfile_cmd()
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    deploy = the_container(torch_docs)["args"]
    expected = dict(zip(deploy[1::2], deploy[2::2]))
    for flag in ("--host", "--metrics-host", "--openai-host", "--openai-port"):
        assert flags[flag] == expected[flag], flag
    text = (ROOT / "docker" / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0", "0:0")
    assert re.search(rf"^EXPOSE {FRONT_PORT} {METRICS_PORT}$", text, re.M)


# ---- mpirun as root and not -----------------------------------------------------------------------------------


@pytest.mark.parametrize("euid, flag", [(0, True), (1000, False)])
def test_mpirun_is_told_it_may_run_as_root_only_as_root(monkeypatch, euid, flag):
    import os

    from trtspec.deploy.launch import Launch

    monkeypatch.setattr(os, "geteuid", lambda: euid)
    cmd = Launch(mpi=True, engine_models=["tensorrt_llm"], devices=[0]).command(["tritonserver"])
    assert cmd[0] == "mpirun" and ("--allow-run-as-root" in cmd) is flag
    assert cmd[1 + flag : 4 + flag] == ["-n", "1", "tritonserver"]


# ---- the Deployment's command, run as the pod runs it ------------------------------------------------------------


def _listening(port: int) -> set[str]:
    """Where a socket listens at `port`, read from /proc/net/tcp and tcp6 (gRPC listens on an IPv6 socket that
    takes IPv4 too), as IPv4 terms: "127.0.0.1" for loopback, "0.0.0.0" for every interface. Nothing is sent."""
    found = set()
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net") / table
        for line in path.read_text().splitlines()[1:] if path.exists() else ():
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            # the kernel writes each 32-bit word of the address in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            ip = ipaddress.ip_address(raw)
            if ip.version == 6:
                ip = ip.ipv4_mapped or (
                    ipaddress.ip_address("127.0.0.1") if ip.is_loopback else ipaddress.ip_address("0.0.0.0")
                )
            found.add(str(ip))
    return found


def _get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture
def pod_like(built_fp8, tmp_path):
    """The tiny FP8 pair deployed, and the writable places the pod mounts emptyDirs at: HOME and /tmp."""
    from trtspec.deploy.writer import write_repository

    loaded = load_config(built_fp8.config)
    repo = write_repository(loaded, built_fp8.engines, tmp_path / "model_repository", device="cpu")
    writable = {name: tmp_path / name for name in ("home", "tmp")}
    for path in writable.values():
        path.mkdir()
    return repo, writable


def _listing(*folders: Path) -> dict[str, float]:
    """The files under `folders` with their modification times, but Python's bytecode caches: the Python backend
    writes them beside each model.py where it can (a read-only volume makes that a silent no-op, as Python's import
    system ignores a cache it cannot write)."""
    return {
        str(p): p.stat().st_mtime
        for folder in folders
        for p in folder.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.mark.server
def test_the_deployment_command_serves_behind_the_key(built_fp8, pod_like):
    """`trtspec serve` with the Deployment's own arguments and environment (keys from the environment, as the Secret
    gives them; HOME, the XDG folders and TMPDIR on the pod's emptyDirs): the front answers /health to anyone and
    everything else only to the API key, Triton's HTTP is on loopback only, the metrics are reachable from outside,
    and the repository and engines (read-only in the pod) are not written to. (The pod's uid cannot be taken here:
    the test interpreter lives under root's 0700 home.)"""
    repo, writable = pod_like
    docs = manifests(load_config(built_fp8.config), repo, image="i", pvc="p")
    container = docs["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]
    http, grpc, metrics, front = free_ports(4)
    port_of = {"--metrics-port": metrics, "--openai-port": front}
    args = [str(port_of.get(prev, a)) for prev, a in zip([None, *container["args"]], container["args"])]
    args += ["--http-port", str(http), "--grpc-port", str(grpc)]
    api_key, admin_key = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    home, tmp = str(writable["home"]), str(writable["tmp"])
    env = {e["name"]: e["value"].replace(k8s.HOME, home).replace("/tmp", tmp) for e in container["env"] if "value" in e}
    env |= {keys.API_ENV: api_key, keys.ADMIN_ENV: admin_key, "OMP_NUM_THREADS": "1"}
    env |= {k: os.environ[k] for k in ("PATH", "LANG") if k in os.environ}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    before = _listing(repo, built_fp8.engines)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trtspec.cli", *args],
        env=env,
        cwd=home,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{front}"
    try:
        deadline = time.monotonic() + 240
        while _get_or_none(f"{base}{HEALTH_PATH}") != 200:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the front did not answer /health within 240 s"
            time.sleep(0.5)
        assert _get(f"{base}/v1/models")[0] == 401
        status, body = _get(f"{base}/v1/models", {"Authorization": f"Bearer {api_key}"})
        assert status == 200 and json.loads(body)["data"]
        assert _get(f"http://127.0.0.1:{http}/v2/health/ready")[0] == 200  # Triton, from inside the pod
        # Triton's HTTP and gRPC listen on loopback alone; the metrics and the front on every interface
        assert _listening(http) == {"127.0.0.1"} and _listening(grpc) == {"127.0.0.1"}
        assert _listening(metrics) == {"0.0.0.0"} and _listening(front) == {"0.0.0.0"}
        status, body = _get(f"http://127.0.0.1:{metrics}/metrics")
        assert status == 200 and b"nv_inference_request_success" in body
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # the pytriton binary's backend directory went under XDG_CACHE_HOME, the server log under TMPDIR
    assert any(Path(env["XDG_CACHE_HOME"]).rglob("libtriton_python.so"))
    assert any(Path(tmp).glob("tritonserver-*.log"))
    assert _listing(repo, built_fp8.engines) == before


def _get_or_none(url: str) -> int | None:
    try:
        return _get(url)[0]
    except OSError:
        return None
