"""The field's schema beside trtspec's own: vLLM's acceptance counters and the endpoint picker's gauges on Triton's
metrics port after known traffic, vLLM's per-request summary, and the Gateway API Inference Extension's
InferencePool and picker settings against their schemas."""

from __future__ import annotations

import copy
import re
import time
import urllib.error
import urllib.request

import jsonschema
import pytest
import yaml

from trtspec import field_metrics
from trtspec.field_metrics import spec_decode_summary

# ---- vLLM's per-request summary ------------------------------------------------------------------------------


def _steps_to_positions(steps: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(drafted, accepted) per verification step -> the BLS's per-position counts, as RequestStats.record makes
    them."""
    width = max((d for d, _ in steps), default=0)
    drafted, accepted = [0] * width, [0] * width
    for d, a in steps:
        for i in range(d):
            drafted[i] += 1
            accepted[i] += i < a
    return drafted, accepted


def _vllm_invariants(summary: dict) -> None:
    """What vLLM's own test of the record checks (tests of --per-request-spec-decode-metrics) and AIPerf 0.13's
    SpecDecodeAcceptanceRecord validates (aiperf/common/models/spec_decode_models.py, vllm_adapter.py)."""
    histogram = summary["acceptance_histogram"]
    assert len(histogram) == summary["num_spec_tokens"] + 1  # AIPerf refuses any other length
    assert all(type(n) is int and n >= 0 for n in histogram)
    assert summary["num_spec_steps"] == sum(histogram)
    assert summary["num_accepted_draft_tokens"] == sum(j * n for j, n in enumerate(histogram))
    assert summary["num_accepted_draft_tokens"] <= summary["num_draft_tokens"]
    if summary["num_spec_steps"]:
        assert summary["mean_acceptance_length"] == pytest.approx(
            1 + summary["num_accepted_draft_tokens"] / summary["num_spec_steps"]
        )
        assert summary["draft_acceptance_rate"] == pytest.approx(
            summary["num_accepted_draft_tokens"] / summary["num_draft_tokens"]
        )
    for k, row in summary.get("acceptance_histogram_by_draft_length", {}).items():
        assert isinstance(k, str) and len(row) == int(k) + 1


def test_the_summary_of_known_steps():
    # four steps of 3 drafts accepting 3, 0, 1, 1
    drafted, accepted = _steps_to_positions([(3, 3), (3, 0), (3, 1), (3, 1)])
    summary = spec_decode_summary(drafted, accepted, num_spec_tokens=4)
    assert summary == {
        "mean_acceptance_length": 1 + 5 / 4,
        "draft_acceptance_rate": 5 / 12,
        "acceptance_histogram": [1, 2, 0, 1, 0],
        "acceptance_histogram_by_draft_length": {"3": [1, 2, 0, 1]},
        "num_spec_steps": 4,
        "num_accepted_draft_tokens": 5,
        "num_draft_tokens": 12,
        "num_spec_tokens": 4,
    }
    _vllm_invariants(summary)


@pytest.mark.parametrize("seed", range(20))
def test_the_histogram_is_exact_for_any_steps(seed):
    """Drafts of varying length (the adaptive K, prompt lookup's short drafts) give the histogram a step-by-step
    count gives; the histogram by draft length is left out where per-position counts cannot split it."""
    import random

    rng = random.Random(seed)
    steps = []
    for _ in range(rng.randint(0, 30)):
        d = rng.randint(1, 6)
        steps.append((d, rng.randint(0, d)))
    summary = spec_decode_summary(*_steps_to_positions(steps), num_spec_tokens=6)
    expected = [0] * 7
    for _, a in steps:
        expected[a] += 1
    assert summary["acceptance_histogram"] == expected
    assert summary["num_draft_tokens"] == sum(d for d, _ in steps)
    assert ("acceptance_histogram_by_draft_length" in summary) == (len({d for d, _ in steps}) <= 1)
    _vllm_invariants(summary)


def test_a_request_that_never_drafted():
    summary = spec_decode_summary([], [], num_spec_tokens=4)
    assert summary["acceptance_histogram"] == [0] * 5 and summary["num_spec_steps"] == 0
    assert summary["mean_acceptance_length"] == 1.0 and summary["draft_acceptance_rate"] == 0.0
    _vllm_invariants(summary)


# ---- the Gateway API Inference Extension ---------------------------------------------------------------------

_LABEL_VALUE = {"type": "string", "maxLength": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
# InferencePool v1's spec as kubernetes-sigs/gateway-api-inference-extension v1.6.0 declares it
# (config/crd/bases/inference.networking.k8s.io_inferencepools.yaml), written out here with every object closed:
# the API server prunes a field the schema does not name, so an unknown field is a setting that silently vanishes.
INFERENCE_POOL_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["selector", "targetPorts"],
            "additionalProperties": False,
            "properties": {
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "minProperties": 1,
                            "maxProperties": 64,
                            "additionalProperties": _LABEL_VALUE,
                        }
                    },
                },
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 8,
                    "items": {
                        "type": "object",
                        "required": ["number"],
                        "additionalProperties": False,
                        "properties": {"number": _PORT},
                    },
                },
                "endpointPickerRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                        "group": {
                            "type": "string",
                            "maxLength": 253,
                            "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
                        },
                        "kind": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 63,
                            "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
                        },
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": {
                            "type": "object",
                            "required": ["number"],
                            "additionalProperties": False,
                            "properties": {"number": _PORT},
                        },
                    },
                },
            },
        },
    },
}


def _pool_problems(doc: dict) -> list[str]:
    """The schema, then the CRD's x-kubernetes-validations (CEL), which JSON Schema cannot say."""
    problems = [e.message for e in jsonschema.Draft202012Validator(INFERENCE_POOL_V1).iter_errors(doc)]
    spec = doc.get("spec") or {}
    ref = spec.get("endpointPickerRef") or {}
    if ref and ref.get("kind", "Service") == "Service" and "port" not in ref:  # self.kind != 'Service' || has(port)
        problems.append("endpointPickerRef: port is required when kind is 'Service' or unspecified")
    numbers = [p.get("number") for p in spec.get("targetPorts") or []]
    if len(numbers) != len(set(numbers)):  # self.all(p1, self.exists_one(p2, p1.number==p2.number))
        problems.append("targetPorts: port number must be unique")
    return problems


# The picker's config as GAIE v1.5.0 reads it (apix/config/v1alpha1/endpointpickerconfig_types.go: the JSON names of
# EndpointPickerConfig, PluginSpec, SchedulingProfile, SchedulingPlugin, DataLayerConfig, DataLayerSource,
# DataLayerExtractor), and the core-metrics-extractor's and metrics-data-source's parameters
# (pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go, source/metrics/datasource.go).
_ENGINE_CONFIG = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        key: {"type": "string"}
        for key in (
            "name",
            "queuedRequestsSpec",
            "runningRequestsSpec",
            "kvUsageSpec",
            "loraSpec",
            "cacheInfoSpec",
            "cacheBlockSizeLabelName",
            "cacheNumBlocksLabelName",
            "cacheBlockSizeSpec",
            "cacheNumBlocksSpec",
        )
    },
}
_REF = {"type": "object", "required": ["pluginRef"], "additionalProperties": False}
PICKER_CONFIG = {
    "type": "object",
    "required": ["apiVersion", "kind", "plugins", "schedulingProfiles"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "inference.networking.x-k8s.io/v1alpha1"},
        "kind": {"const": "EndpointPickerConfig"},
        "featureGates": {"type": "array", "items": {"type": "string"}},
        "plugins": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type"],
                "additionalProperties": False,
                "properties": {"name": {"type": "string"}, "type": {"type": "string"}, "parameters": {}},
            },
        },
        "schedulingProfiles": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "plugins"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string"},
                    "plugins": {
                        "type": "array",
                        "items": _REF | {"properties": {"pluginRef": {"type": "string"}, "weight": {"type": "number"}}},
                    },
                },
            },
        },
        "dataLayer": {
            "type": "object",
            "required": ["sources"],
            "additionalProperties": False,
            "properties": {
                "sources": {
                    "type": "array",
                    "items": _REF
                    | {
                        "properties": {
                            "pluginRef": {"type": "string"},
                            "extractors": {
                                "type": "array",
                                "items": _REF | {"properties": {"pluginRef": {"type": "string"}}},
                            },
                        }
                    },
                }
            },
        },
    },
}
PLUGIN_PARAMETERS = {
    "core-metrics-extractor": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "engineLabelKey": {"type": "string"},
            "defaultEngine": {"type": "string"},
            "engineConfigs": {"type": "array", "items": _ENGINE_CONFIG},
        },
    },
    "metrics-data-source": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "scheme": {"enum": ["http", "https"]},
            "path": {"type": "string"},
            "insecureSkipVerify": {"type": "boolean"},
        },
    },
}


def _picker_problems(config: dict) -> list[str]:
    problems = [e.message for e in jsonschema.Draft202012Validator(PICKER_CONFIG).iter_errors(config)]
    names = set()
    for plugin in config.get("plugins") or []:
        names.add(plugin.get("name") or plugin.get("type"))
        schema = PLUGIN_PARAMETERS.get(plugin.get("type"))
        if schema and "parameters" in plugin:
            problems += [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(plugin["parameters"])]
    refs = [p["pluginRef"] for prof in config.get("schedulingProfiles") or [] for p in prof.get("plugins") or []]
    for source in (config.get("dataLayer") or {}).get("sources") or []:
        refs += [source["pluginRef"]] + [e["pluginRef"] for e in source.get("extractors") or []]
    problems += [f"pluginRef {ref} names no plugin" for ref in refs if ref not in names]
    return problems


@pytest.fixture
def pool_docs(built_fp8, model_repository, tmp_path):
    from trtspec.config import load_config
    from trtspec.deploy.k8s import write_manifests

    out = tmp_path / "k8s"
    write_manifests(
        load_config(built_fp8.config), model_repository, out, image="r/trtspec:1", pvc="e", inference_pool_too=True
    )
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(out.glob("*.yaml"))}


def test_the_inference_pool_meets_the_crd_schema(pool_docs):
    import kubernetes_validate

    pool, deployment = pool_docs["inferencepool.yaml"], pool_docs["deployment.yaml"]
    assert _pool_problems(pool) == []
    # the pool is the deployment's pods, served on the front's port, picked by the picker the settings configure
    assert pool["spec"]["selector"]["matchLabels"] == deployment["spec"]["template"]["metadata"]["labels"]
    front = {p["name"]: p["containerPort"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert pool["spec"]["targetPorts"] == [{"number": front["openai"]}]
    settings = pool_docs["endpoint-picker.yaml"]
    assert settings["metadata"]["name"] == pool["spec"]["endpointPickerRef"]["name"]
    for doc in (settings, pool_docs["networkpolicy.yaml"]):
        kubernetes_validate.validate(doc, "1.30.0", strict=True)


def test_the_picker_reads_the_names_trtspec_exports(pool_docs):
    (config_text,) = pool_docs["endpoint-picker.yaml"]["data"].values()
    config = yaml.safe_load(config_text)
    assert _picker_problems(config) == []
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]
    (engine,) = extractor["engineConfigs"]
    assert extractor["defaultEngine"] == engine["name"]
    assert (engine["queuedRequestsSpec"], engine["runningRequestsSpec"], engine["kvUsageSpec"]) == (
        field_metrics.REQUESTS_WAITING,
        field_metrics.REQUESTS_RUNNING,
        field_metrics.KV_CACHE_USAGE,
    )
    # the picker is told to scrape the metrics port, where those are, and the NetworkPolicy lets it
    from trtspec.deploy.k8s import picker_args

    pool = pool_docs["inferencepool.yaml"]["metadata"]["name"]
    assert "--model-server-metrics-port=8002" in picker_args(pool) and f"--pool-name={pool}" in picker_args(pool)
    ingress = pool_docs["networkpolicy.yaml"]["spec"]["ingress"]
    picker_rule = [r for r in ingress if any("podSelector" in f for f in r.get("from", []))]
    assert picker_rule and picker_rule[0]["ports"] == [{"port": 8002, "protocol": "TCP"}]


def test_the_schema_checks_find_what_the_schemas_refuse(pool_docs):
    good = pool_docs["inferencepool.yaml"]
    breaches = {
        "Additional properties": lambda d: d["spec"].update(targetPortNumber=9000),  # the pre-v1 field
        "is not one of": lambda d: d["spec"]["endpointPickerRef"].update(failureMode="Closed"),
        "should be non-empty": lambda d: d["spec"].update(targetPorts=[]),
        "is greater than the maximum": lambda d: d["spec"]["targetPorts"][0].update(number=70000),
        "port is required": lambda d: d["spec"]["endpointPickerRef"].pop("port"),
        "must be unique": lambda d: d["spec"]["targetPorts"].append({"number": 9000}),
        "does not match": lambda d: d["spec"]["selector"]["matchLabels"].update(app="-bad-"),
        "'selector' is a required property": lambda d: d["spec"].pop("selector"),
    }
    for expected, edit in breaches.items():
        doc = copy.deepcopy(good)
        edit(doc)
        found = _pool_problems(doc)
        assert any(expected in p for p in found), (expected, found)
    (config_text,) = pool_docs["endpoint-picker.yaml"]["data"].values()
    config = yaml.safe_load(config_text)
    wrong = copy.deepcopy(config)
    wrong["data"] = wrong.pop("dataLayer")  # a name GAIE's docs used that its config types do not read
    assert any("Additional properties" in p for p in _picker_problems(wrong))
    wrong = copy.deepcopy(config)
    next(p for p in wrong["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]["engineConfigs"][0][
        "kvUsage"
    ] = "x"
    assert any("Additional properties" in p for p in _picker_problems(wrong))
    wrong = copy.deepcopy(config)
    wrong["schedulingProfiles"][0]["plugins"].append({"pluginRef": "prefix-cache-scorer"})
    assert _picker_problems(wrong) == ["pluginRef prefix-cache-scorer names no plugin"]


def test_the_pool_needs_the_manifests(tmp_path):
    from click.testing import CliRunner

    from trtspec.cli import cli

    result = CliRunner().invoke(
        cli, ["deploy", "-c", "build_configs/demo.yaml", "--repo", str(tmp_path), "--inference-pool"]
    )
    assert result.exit_code == 2 and "--inference-pool: give --k8s DIR too" in result.output


# ---- the series on a real server, after known traffic --------------------------------------------------------


def _scrape(url: str) -> dict[str, float]:
    values = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def _sample(values: dict[str, float], name: str, **labels) -> float | None:
    """The samples of `name` carrying these labels (and any others, e.g. trtspec's draft_version), summed; None when
    there is none."""
    found = None
    for key, value in values.items():
        base, _, rest = key.partition("{")
        if base == name and labels.items() <= dict(re.findall(r'(\w+)="([^"]*)"', rest)).items():
            found = (found or 0.0) + value
    return found


@pytest.fixture(scope="module")
def field_server(model_repository):
    from trtspec.server import TritonServer, free_port

    server = TritonServer(model_repository, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    server.start(timeout=300)
    yield server
    server.stop()


@pytest.mark.server
def test_vllm_series_after_known_traffic(field_server):
    """Requests of fixed draft lengths through the BLS: vLLM's four series move by exactly what the requests' own
    per-position counts say, and by what trtspec's own series move."""
    from trtspec.client import SpecClient

    labels = {"model_name": "tensorrt_llm_bls", "engine": "0"}
    trtspec_labels = {"model": "tensorrt_llm_bls"}
    before = _scrape(field_server.metrics_url)
    with SpecClient(field_server.grpc_url, protocol="grpc") as client:
        done = [
            client.generate(prompt, max_tokens=24, num_draft_tokens=k, adaptive_draft_length=False)
            for prompt, k in (("The quick brown fox", 3), ("def add(a, b):", 2), ("The quick brown fox", 0))
        ]
    after = _scrape(field_server.metrics_url)
    for key in after:  # vLLM's labels, and only those
        if key.startswith("vllm:"):
            assert set(re.findall(r'(\w+)="', key)) - {"position"} == {"model_name", "engine"}, key

    def moved(name, **extra):
        return (_sample(after, name, **extra) or 0.0) - (_sample(before, name, **extra) or 0.0)

    steps = sum(c.drafted_per_position[0] for c in done if c.drafted_per_position)
    drafted = sum(sum(c.drafted_per_position) for c in done)
    accepted = sum(sum(c.accepted_per_position) for c in done)
    assert (
        steps > 0
        and drafted == sum(c.draft_tokens for c in done)
        and accepted == sum(c.accepted_draft_tokens for c in done)
    )
    assert moved(field_metrics.SPEC_DRAFTS, **labels) == steps
    assert moved(field_metrics.SPEC_DRAFT_TOKENS, **labels) == drafted
    assert moved(field_metrics.SPEC_ACCEPTED, **labels) == accepted
    assert moved("trtspec_draft_tokens_total", **trtspec_labels) == drafted
    assert moved("trtspec_accepted_tokens_total", **trtspec_labels) == accepted
    max_draft_len = int(_scrape_build(after)["max_draft_len"])
    for i in range(max_draft_len):  # every position from the start, as vLLM's
        at_i = sum(c.accepted_per_position[i] for c in done if len(c.accepted_per_position) > i)
        assert moved(field_metrics.SPEC_ACCEPTED_PER_POS, **labels, position=str(i)) == at_i, i
        if at_i:
            assert moved("trtspec_accepted_tokens_by_position_total", **trtspec_labels, position=str(i)) == at_i
    # nothing in flight now; the target's KV-cache use, read once a second from the server's own metrics
    assert _sample(after, field_metrics.REQUESTS_RUNNING, **labels) == 0
    assert _sample(after, field_metrics.REQUESTS_WAITING, **labels) == 0
    deadline = time.monotonic() + 60
    while (kv := _sample(_scrape(field_server.metrics_url), field_metrics.KV_CACHE_USAGE, **labels)) is None:
        assert time.monotonic() < deadline, "no KV-cache usage within 60 s"
        time.sleep(0.5)
    assert 0 <= kv <= 1


def _scrape_build(values: dict[str, float]) -> dict[str, str]:
    (key,) = [k for k in values if k.startswith("trtspec_build_info{")]
    return dict(re.findall(r'(\w+)="([^"]*)"', key))


# ---- vLLM's per-request summary through the OpenAI front -----------------------------------------------------


def _post(url: str, body: dict) -> bytes:
    import json

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as answer:
        return answer.read()


@pytest.mark.server
def test_the_front_sends_vllms_summary_and_it_adds_up_to_the_counters(field_server):
    """`--per-request-spec-decode-metrics summary`: every response carries vLLM's record (streamed: on the usage
    chunk alone, as vLLM's), equal to the request's own speculation figures, and summed over the requests it equals
    what the vLLM counters moved by; at `none` responses carry no `metrics`."""
    import json

    from trtspec.openai_api import Deployment, Front
    from trtspec.server import free_port

    labels = {"model_name": "tensorrt_llm_bls", "engine": "0"}
    summaries, own = [], []
    deployment = Deployment(field_server.http_url, served_model_name="m", spec_decode_metrics="summary").connect()
    before = _scrape(field_server.metrics_url)
    with Front(deployment, port=free_port()) as front:
        for path, body in (
            ("completions", {"prompt": "The quick brown fox", "max_tokens": 24}),
            ("completions", {"prompt": "def add(a, b):", "max_tokens": 24}),
        ):
            out = json.loads(_post(f"{front.url}/v1/{path}", {"model": "m", "temperature": 0, **body}))
            summaries.append(out["metrics"]["speculative_decoding"])
            own.append(out["speculation"])
            stream = {"model": "m", "stream": True, "stream_options": {"include_usage": True}, **body}
            events = [
                json.loads(line[len("data: ") :])
                for line in _post(f"{front.url}/v1/{path}", stream).decode().splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
            with_metrics = [e for e in events if e.get("metrics") is not None]
            assert len(with_metrics) == 1 and with_metrics[0] is events[-1] and events[-1]["usage"]
            summaries.append(events[-1]["metrics"]["speculative_decoding"])
            own.append(next(e["speculation"] for e in events if "speculation" in e))
    after = _scrape(field_server.metrics_url)
    for summary, figures in zip(summaries, own):
        assert set(summary) - {"acceptance_histogram_by_draft_length"} == {
            "mean_acceptance_length",
            "draft_acceptance_rate",
            "acceptance_histogram",
            "num_spec_steps",
            "num_accepted_draft_tokens",
            "num_draft_tokens",
            "num_spec_tokens",
        }
        _vllm_invariants(summary)
        assert summary["num_spec_tokens"] == int(_scrape_build(after)["max_draft_len"])
        assert (summary["num_draft_tokens"], summary["num_accepted_draft_tokens"]) == (
            figures["draft_tokens"],
            figures["accepted_draft_tokens"],
        )

    def moved(name):
        return (_sample(after, name, **labels) or 0.0) - (_sample(before, name, **labels) or 0.0)

    assert sum(s["num_spec_steps"] for s in summaries) == moved(field_metrics.SPEC_DRAFTS) > 0
    assert sum(s["num_draft_tokens"] for s in summaries) == moved(field_metrics.SPEC_DRAFT_TOKENS)
    assert sum(s["num_accepted_draft_tokens"] for s in summaries) == moved(field_metrics.SPEC_ACCEPTED)
    plain = Deployment(field_server.http_url, served_model_name="m").connect()
    with Front(plain, port=free_port()) as front:
        out = json.loads(_post(f"{front.url}/v1/completions", {"model": "m", "prompt": "The", "max_tokens": 4}))
    assert "metrics" not in out


@pytest.mark.server
def test_the_front_serves_the_metrics_where_aiperf_looks(field_server):
    """AIPerf reads a server's metrics at its API's base URL + /metrics, checking it first with HEAD and then GET
    on one keep-alive connection: the front answers both there (HEAD without a body), with Triton's metrics."""
    import http.client

    from trtspec.openai_api import Deployment, Front
    from trtspec.server import free_port

    deployment = Deployment(field_server.http_url, served_model_name="m", metrics_url=field_server.metrics_url)
    with Front(deployment.connect(), port=free_port()) as front:
        host, port = front.url.removeprefix("http://").rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            connection.request("HEAD", "/metrics")
            head = connection.getresponse()
            assert head.status == 200 and head.read() == b""
            connection.request("GET", "/metrics")
            got = connection.getresponse()
            text = got.read().decode()
        finally:
            connection.close()
    assert got.status == 200 and got.getheader("Content-Type").startswith("text/plain")
    assert f"\n{field_metrics.SPEC_DRAFTS}{{" in text and "\nnv_inference_request_success{" in text
    with Front(Deployment(field_server.http_url, served_model_name="m").connect(), port=free_port()) as front:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{front.url}/metrics", timeout=60)
    assert refused.value.code == 404
