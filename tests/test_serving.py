"""Speculative decoding through the real tritonserver: the BLS, both engine models, HTTP and gRPC clients."""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from trtspec.contract import BLS_INPUTS

PROMPTS = ["The quick brown fox", "def add(a, b):"]
BLS_TYPES = {t.name: t for t in BLS_INPUTS}
BLS = "tensorrt_llm_bls"


# ---- raw clients (stock tritonclient and the generate extension, as a user would call them) ----------------


def grpc_generate(url: str, fields: dict, timeout: float = 120.0, first=None) -> list[dict]:
    """Send one request to the decoupled BLS over gRPC; return every response's outputs. `first`: a
    threading.Event set when the first response with outputs arrives."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        inputs = []
        for name, value in fields.items():
            spec = BLS_TYPES[name]
            if spec.dtype == "STRING":
                arr = np.asarray([[v.encode() for v in np.atleast_1d(value)]], dtype=np.object_)
            else:
                arr = np.asarray([np.atleast_1d(value)]).astype(spec.np_dtype)
            tensor = grpcclient.InferInput(name, list(arr.shape), "BYTES" if spec.dtype == "STRING" else spec.dtype)
            tensor.set_data_from_numpy(arr)
            inputs.append(tensor)
        client.async_stream_infer(BLS, inputs, enable_empty_final_response=True)
        out = []
        while True:
            result, error = responses.get(timeout=timeout)
            if error is not None:
                raise error
            final = result.get_response().parameters["triton_final_response"].bool_param
            names = [o.name for o in result.get_response().outputs]
            if names:
                out.append({n: result.as_numpy(n) for n in names})
                if first is not None:
                    first.set()
            if final:
                return out
    finally:
        client.stop_stream()
        client.close()


def http_generate(base: str, fields: dict, stream: bool = False) -> list[dict]:
    path = "generate_stream" if stream else "generate"
    req = urllib.request.Request(
        f"{base}/v2/models/{BLS}/{path}", data=json.dumps(fields).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        body = resp.read().decode()
    if not stream:
        return [json.loads(body)]
    events = [json.loads(line[5:]) for line in body.splitlines() if line.startswith("data:")]
    errors = [e["error"] for e in events if "error" in e]
    if errors:
        raise RuntimeError(errors[0])
    return events


def ids_of(responses, key="output_ids") -> list[int]:
    return [int(t) for r in responses for t in np.asarray(r.get(key, [])).reshape(-1)]


def text_of(responses) -> str:
    parts = []
    for r in responses:
        value = r["text_output"]
        for v in np.asarray(value, dtype=object).reshape(-1):
            parts.append(v.decode() if isinstance(v, bytes) else str(v))
    return "".join(parts)


# ---- tests ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["embedded", "tensorrtllm-standin"])
def spec_server(tmp_path_factory, request):
    """A 3-layer target, a perturbed copy as its draft (about half the draft tokens accepted), max_draft_len 8,
    deployed and served by the real tritonserver; every test runs twice: on the embedded engine models, and on
    the strict stand-in of TensorRT-LLM's tensorrtllm backend with the TensorRT deployment's engine configs."""
    from support.standin_repo import write_standin_repository
    from support.tiny import make_checkpoint, make_perturbed_copy, write_config

    from trtspec.compile import run_build
    from trtspec.config import load_config
    from trtspec.deploy.writer import write_repository
    from trtspec.server import TritonServer, free_port

    root = tmp_path_factory.mktemp("serving")
    target = make_checkpoint(root / "target", layers=3, seed=0)
    draft = make_perturbed_copy(target, root / "draft", noise=0.01)
    config = write_config(
        root / "build.yaml",
        target,
        draft,
        speculation={"max_draft_len": 8},
        engine={"max_input_len": 256, "max_seq_len": 512},
    )
    engines = run_build(config, root / "engines")
    # Above 4 requests in flight, new ones start without speculation (the concurrency test checks it).
    write = write_repository if request.param == "embedded" else write_standin_repository
    repo = write(
        load_config(config) if request.param == "embedded" else config,
        engines,
        root / "repo",
        overrides={"max_speculative_concurrency": 4},
    )
    server = TritonServer(
        repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), control_file=root / "force.json"
    )
    server.start(timeout=300)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def references(spec_server):
    """Target-only outputs (num_draft_tokens 0: a request without it speculates)."""
    return {
        p: ids_of(grpc_generate(spec_server.grpc_url, {"text_input": p, "max_tokens": 24, "num_draft_tokens": 0}))
        for p in PROMPTS
    }


def test_references_are_full_length(references):
    assert all(len(ids) == 24 for ids in references.values())


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_speculative_equals_target_only_grpc(spec_server, references, k):
    for prompt in PROMPTS:
        for stream in (False, True):
            responses = grpc_generate(
                spec_server.grpc_url,
                {
                    "text_input": prompt,
                    "max_tokens": 24,
                    "num_draft_tokens": k,
                    "stream": stream,
                    "return_perf_metrics": True,
                    "adaptive_draft_length": False,  # draft K every iteration, whatever it costs
                },
            )
            assert ids_of(responses) == references[prompt], (prompt, k, stream)
            perf = responses[-1]
            assert int(perf["total_draft_tokens"].reshape(-1)[0]) > 0
            assert 0 <= float(perf["acceptance_rate"].reshape(-1)[0]) <= 1
            if stream:
                assert len(responses) > 1  # one response per iteration, then the final one


def test_final_perf_metrics_only_sends_them_once(spec_server, references):
    """final_perf_metrics_only (what the OpenAI front asks for): a streamed request's perf metrics come with its
    final response alone, the same figures as on every response without it, and the tokens are unchanged."""
    fields = {
        "text_input": PROMPTS[0],
        "max_tokens": 24,
        "num_draft_tokens": 2,
        "speculation": "draft_model",
        "adaptive_draft_length": False,
        "return_perf_metrics": True,
        "stream": True,
    }
    every = http_generate(spec_server.http_base_url, fields, stream=True)
    once = http_generate(spec_server.http_base_url, fields | {"final_perf_metrics_only": True}, stream=True)
    assert ids_of(once) == ids_of(every) == references[PROMPTS[0]]
    assert all("acceptance_rate" in e for e in every) and len(every) > 2
    assert [("acceptance_rate" in e) for e in once] == [False] * (len(once) - 1) + [True]
    for name in ("total_draft_tokens", "total_accepted_draft_tokens", "num_iterations", "finish_reason"):
        assert once[-1][name] == every[-1][name], name


@pytest.mark.parametrize("k", [2, 5])
def test_greedy_speculative_equals_target_only_http(spec_server, references, k):
    for prompt in PROMPTS:
        single = http_generate(
            spec_server.http_base_url, {"text_input": prompt, "max_tokens": 24, "num_draft_tokens": k}
        )
        assert single[0]["output_ids"] == references[prompt]
        assert single[0]["text_output"].startswith(prompt)  # the prompt is repeated, as TRT-LLM does by default
        events = http_generate(
            spec_server.http_base_url,
            {"text_input": prompt, "max_tokens": 24, "num_draft_tokens": k, "stream": True},
            stream=True,
        )
        assert [t for e in events for t in np.atleast_1d(e["output_ids"]).tolist()] == references[prompt]
        assert prompt + "".join(e["text_output"] for e in events) == single[0]["text_output"]


def test_eight_concurrent_streams(spec_server, references):
    results, reasons, errors = {}, {}, []

    def one(i):
        prompt = PROMPTS[i % 2]
        try:
            responses = grpc_generate(
                spec_server.grpc_url,
                {
                    "text_input": prompt,
                    "max_tokens": 24,
                    "num_draft_tokens": 1 + i % 4,
                    "stream": True,
                    "return_perf_metrics": True,
                },
            )
            results[i] = ids_of(responses)
            reasons[i] = [v.decode() for v in np.asarray(responses[-1]["fallback_reasons"]).reshape(-1)]
        except Exception as exc:  # collected and reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert all(results[i] == references[PROMPTS[i % 2]] for i in range(8))
    # the deployment allows 4 speculative requests at once: the others started without speculation
    assert 1 <= sum("load:1" in r for r in reasons.values()) <= 4


def test_prompt_lookup_and_auto_equal_target_only(spec_server):
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):"
    reference = ids_of(
        grpc_generate(spec_server.grpc_url, {"text_input": prompt, "max_tokens": 24, "num_draft_tokens": 0})
    )
    for method in ("prompt_lookup", "auto"):
        for adaptive in (False, True):
            responses = grpc_generate(
                spec_server.grpc_url,
                {
                    "text_input": prompt,
                    "max_tokens": 24,
                    "speculation": method,
                    "num_draft_tokens": 4,
                    "adaptive_draft_length": adaptive,
                    "return_perf_metrics": True,
                },
            )
            assert ids_of(responses) == reference
            sources = {s.decode().split(":")[0] for s in responses[-1]["draft_sources"].reshape(-1)}
            assert sources <= ({"prompt_lookup"} if method == "prompt_lookup" else {"prompt_lookup", "draft_model"})
            if method == "auto" and not adaptive:  # where lookup finds nothing, the draft model drafts
                assert int(responses[-1]["total_draft_tokens"].reshape(-1)[0]) > 0


def test_a_request_without_speculation_fields_speculates(spec_server, references):
    """The deployment's default (the build config's K, auto, adaptive) applies to clients that know nothing of
    trtspec; num_draft_tokens 0 turns it off."""
    for prompt in PROMPTS:
        default = grpc_generate(
            spec_server.grpc_url, {"text_input": prompt, "max_tokens": 24, "return_perf_metrics": True}
        )
        assert ids_of(default) == references[prompt]
        # it drafted, or its adaptive policy judged drafting not to pay here (the costs this server learned)
        reasons = [r.decode() for r in default[-1]["fallback_reasons"].reshape(-1)]
        assert int(default[-1]["total_draft_tokens"].reshape(-1)[0]) > 0 or any(
            r.startswith("low_acceptance") for r in reasons
        )
        off = grpc_generate(
            spec_server.grpc_url,
            {"text_input": prompt, "max_tokens": 24, "num_draft_tokens": 0, "return_perf_metrics": True},
        )
        assert int(off[-1]["total_draft_tokens"].reshape(-1)[0]) == 0 and off[-1]["draft_sources"].size == 0
        assert off[-1]["fallback_reasons"].size == 0


def test_unknown_speculation_method_is_refused(spec_server):
    with pytest.raises(InferenceServerException) as err:
        grpc_generate(spec_server.grpc_url, {"text_input": "hi", "max_tokens": 4, "speculation": "medusa"})
    assert "speculation" in str(err.value)


def test_sampling_reproducible_with_seed(spec_server):
    fields = {
        "text_input": PROMPTS[0],
        "max_tokens": 20,
        "num_draft_tokens": 3,
        "temperature": 0.9,
        "top_k": 40,
        "use_draft_logits": True,
        "seed": 7,
    }
    first = ids_of(grpc_generate(spec_server.grpc_url, fields))
    second = ids_of(grpc_generate(spec_server.grpc_url, fields))
    other = ids_of(grpc_generate(spec_server.grpc_url, fields | {"seed": 8}))
    assert first == second and len(first) == 20
    assert first != other


@pytest.mark.parametrize(
    "fields, field_name",
    [
        ({"max_tokens": 8}, "text_input"),
        ({"text_input": "", "max_tokens": 8}, "text_input"),
        ({"text_input": "hello", "max_tokens": 0}, "max_tokens"),
        ({"text_input": "hello", "max_tokens": 100000}, "max_tokens"),
        ({"text_input": "hello", "max_tokens": 8, "num_draft_tokens": 9}, "num_draft_tokens"),
        ({"text_input": "hello " * 200, "max_tokens": 8}, "text_input"),
        ({"text_input": "hello", "max_tokens": 8, "top_p": 1.5}, "top_p"),
        # this deployment's target was built without them (engine.gather_*_logits), as TensorRT-LLM's executor refuses
        ({"text_input": "hello", "max_tokens": 8, "return_context_logits": True}, "return_context_logits"),
        ({"text_input": "hello", "max_tokens": 8, "return_generation_logits": True}, "return_generation_logits"),
    ],
)
def test_bad_requests_get_a_clear_error_and_the_server_keeps_serving(spec_server, references, fields, field_name):
    with pytest.raises(InferenceServerException) as err:
        grpc_generate(spec_server.grpc_url, fields)
    assert field_name in str(err.value)
    assert (
        ids_of(grpc_generate(spec_server.grpc_url, {"text_input": PROMPTS[0], "max_tokens": 24, "num_draft_tokens": 2}))
        == references[PROMPTS[0]]
    )


def test_wrong_type_is_refused_by_triton(spec_server):
    client = grpcclient.InferenceServerClient(spec_server.grpc_url)
    try:
        text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
        text.set_data_from_numpy(np.asarray([[b"hello"]], dtype=np.object_))
        tokens = grpcclient.InferInput("max_tokens", [1, 1], "FP32")
        tokens.set_data_from_numpy(np.asarray([[8.0]], dtype=np.float32))
        errors: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: errors.put(error))
        client.async_stream_infer(BLS, [text, tokens])
        error = errors.get(timeout=60)
    finally:
        client.stop_stream()
        client.close()
    assert error is not None and "max_tokens" in str(error)
    with pytest.raises(urllib.error.HTTPError):  # over HTTP Triton's JSON parser refuses it before the model
        http_generate(spec_server.http_base_url, {"text_input": "hello", "max_tokens": "many"})


def read_metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("trtspec_"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_metrics_move(spec_server):
    before = read_metrics(spec_server.metrics_url)
    grpc_generate(
        spec_server.grpc_url,
        {"text_input": PROMPTS[1], "max_tokens": 24, "num_draft_tokens": 4, "adaptive_draft_length": False},
    )
    after = read_metrics(spec_server.metrics_url)

    def total(values, prefix):
        return sum(v for k, v in values.items() if k.startswith(prefix))

    assert total(after, "trtspec_draft_tokens_total") > total(before, "trtspec_draft_tokens_total")
    assert total(after, "trtspec_iterations_total") > total(before, "trtspec_iterations_total")
    assert total(after, "trtspec_generated_tokens_total") - total(before, "trtspec_generated_tokens_total") == 24
    assert any('position="0"' in k for k in after if k.startswith("trtspec_draft_tokens_by_position_total"))
    speculative = [k for k in after if k.startswith("trtspec_requests_total") and 'mode="speculative"' in k]
    assert speculative and sum(after[k] - before.get(k, 0) for k in speculative) == 1


def test_latency_error_and_deployment_metrics(spec_server):
    """Histograms by mode (latency with edges at 3 s and 5 s), per-request acceptance, errors by kind, draft and
    verify seconds, the learned break-even acceptance and the build info, as a scrape shows them."""
    from tritonclient.utils import InferenceServerException

    before = read_metrics(spec_server.metrics_url)
    grpc_generate(
        spec_server.grpc_url,
        {"text_input": PROMPTS[1], "max_tokens": 16, "num_draft_tokens": 4, "adaptive_draft_length": False},
    )
    grpc_generate(spec_server.grpc_url, {"text_input": PROMPTS[1], "max_tokens": 16, "num_draft_tokens": 0})
    middle = read_metrics(spec_server.metrics_url)
    grpc_generate(
        spec_server.grpc_url, {"text_input": PROMPTS[1], "max_tokens": 16, "num_draft_tokens": 0, "stream": True}
    )
    for bad in (
        {"text_input": PROMPTS[1], "max_tokens": 0},
        {"text_input": PROMPTS[1], "max_tokens": 200, "timeout_ms": 1, "num_draft_tokens": 0},
    ):
        with pytest.raises(InferenceServerException):
            grpc_generate(spec_server.grpc_url, bad)
    after = read_metrics(spec_server.metrics_url)

    def find(values, name, **labels):  # a sample by name and labels, whatever their order in the scrape
        want = {f'{k}="{v}"' for k, v in {"model": "tensorrt_llm_bls", **labels}.items()}
        for key, value in values.items():
            if key.split("{")[0] == name and set(key.split("{", 1)[1].rstrip("}").split(",")) == want:
                return value
        return None

    def moved(name, **labels):
        return (find(after, name, **labels) or 0.0) - (find(before, name, **labels) or 0.0)

    for mode, requests in (("speculative", 1), ("plain", 2)):
        for hist in ("trtspec_request_duration_seconds", "trtspec_time_to_first_token_seconds"):
            assert moved(f"{hist}_count", mode=mode) == requests, (hist, mode)
        assert moved("trtspec_generated_tokens_total", mode=mode) == 16 * requests
    # the plain request not streamed got its tokens in one piece: no time per output token of its own
    tpot = "trtspec_time_per_output_token_seconds_count"
    assert moved(tpot, mode="speculative") == 1 and moved(tpot, mode="plain") == 1
    assert find(middle, tpot, mode="plain") == find(before, tpot, mode="plain")
    for mode in ("speculative", "plain"):
        for edge in ("3", "5"):  # the latency alerts' thresholds are bucket edges
            assert find(after, "trtspec_request_duration_seconds_bucket", mode=mode, le=edge) is not None
    assert moved("trtspec_request_acceptance_ratio_count") == 1
    assert 0 <= moved("trtspec_request_acceptance_ratio_sum") <= 1
    assert moved("trtspec_request_errors_total", kind="bad_request") == 1
    assert moved("trtspec_request_errors_total", kind="timeout") == 1
    assert moved("trtspec_draft_seconds_total") > 0 and moved("trtspec_verify_seconds_total") > 0
    assert 0 < find(after, "trtspec_break_even_acceptance", load="1") <= 1
    states = {  # the lone requests' load range, there from the start
        st: find(after, "trtspec_speculation_state", load="1", state=st)
        for st in ("speculating", "reduced", "plain", "probing")
    }
    assert sorted(states.values()) == [0, 0, 0, 1]  # one state at a time
    assert find(after, "trtspec_draft_length_cap", load="1") == {"speculating": 4, "reduced": 2}.get(
        max(states, key=states.get), 0
    )
    info = [k for k in after if k.startswith("trtspec_build_info{")]
    assert len(info) == 1 and 'max_draft_len="8"' in info[0] and 'quantization="fp8' in info[0] and after[info[0]] == 1


def test_a_forced_mode_reaches_the_bls_and_is_counted(spec_server):
    """`trtspec serve --control-port`'s receiver forces plain decoding: the BLS's next request (the file is re-read
    at most twice a second) drafts nothing, the state gauge says plain, the change is counted with its reason; the
    release returns the level from before, counted too."""
    from test_control import TOKEN, call

    from trtspec.control import ControlServer

    control = ControlServer(spec_server.control_file, token=TOKEN).start()
    url = f"http://127.0.0.1:{control.port}/control"
    request = {"text_input": PROMPTS[1], "max_tokens": 16, "num_draft_tokens": 4, "adaptive_draft_length": False}

    def state(values):  # of the lone requests' load range (the requests here run one at a time)
        return next(
            k.split('state="')[1].split('"')[0]
            for k, v in values.items()
            if k.startswith("trtspec_speculation_state{") and 'load="1"' in k and v == 1
        )

    def moved(before, after, prefix):
        return sum(after[k] - before.get(k, 0) for k in after if k.startswith(prefix))

    try:
        before = read_metrics(spec_server.metrics_url)
        assert call(url, {"mode": "plain", "for_seconds": 120, "reason": "test"})[0] == 200
        time.sleep(0.6)
        grpc_generate(spec_server.grpc_url, request)
        forced = read_metrics(spec_server.metrics_url)
        assert state(forced) == "plain"
        assert moved(before, forced, "trtspec_draft_tokens_total") == 0
        assert moved(before, forced, 'trtspec_fallbacks_total{model="tensorrt_llm_bls",reason="governor"}') == 1
        # one change in each load range seen (earlier tests ran requests side by side), once in the lone requests'
        ranges = {k.split('load="')[1].split('"')[0] for k in forced if k.startswith("trtspec_speculation_state{")}
        assert moved(before, forced, "trtspec_speculation_changes_total") == len(ranges)
        assert (
            sum(
                forced[k] - before.get(k, 0)
                for k in forced
                if k.startswith("trtspec_speculation_changes_total") and 'load="1"' in k
            )
            == 1
        )
        assert [k for k in forced if 'reason="operator"' in k and k.startswith("trtspec_speculation_changes_total")]
        assert call(url, {"mode": "auto"})[0] == 200
        time.sleep(0.6)
        grpc_generate(spec_server.grpc_url, request)
        released = read_metrics(spec_server.metrics_url)
        assert state(released) == state(before)
        assert [
            k for k in released if 'reason="force_release"' in k and k.startswith("trtspec_speculation_changes_total")
        ]
    finally:
        call(url, {"mode": "auto"})
        control.stop()


# ---- streamed plain decoding: one engine call per plain stretch ----------------------------------------------


def engine_metric(server, name: str, model: str = "tensorrt_llm") -> float:
    time.sleep(0.6)  # what happened is sent within one report period (engine_model.REPORT_SECONDS, 0.25 s)
    return read_metrics(server.metrics_url).get(f'{name}{{model="{model}"}}', 0.0)


def test_a_streamed_plain_request_is_one_engine_call(spec_server):
    fields = {"text_input": PROMPTS[0], "max_tokens": 40, "end_id": -1, "num_draft_tokens": 0}
    whole = grpc_generate(spec_server.grpc_url, fields)
    for stream in (
        lambda f: grpc_generate(spec_server.grpc_url, f),
        lambda f: http_generate(spec_server.http_base_url, f, stream=True),
    ):
        calls = engine_metric(spec_server, "trtspec_engine_calls_total")
        parts = stream(fields | {"stream": True})
        assert ids_of(parts) == ids_of(whole) and len(ids_of(whole)) == 40
        # relayed as they come: a token per response while the reader keeps up, several in one where it fell behind
        # (one per token for a reader that keeps up: tests/test_stream_coalescing.py)
        assert 0 < len([p for p in parts if ids_of([p])]) <= 40
        assert engine_metric(spec_server, "trtspec_engine_calls_total") - calls == 1  # not 40


def test_streamed_speculation_equals_target_only(spec_server):
    """Prompt lookup on text it mostly cannot predict: iterations that draft and iterations that do not, streamed."""
    fields = {"text_input": PROMPTS[1], "max_tokens": 120, "end_id": -1}
    reference = ids_of(grpc_generate(spec_server.grpc_url, fields | {"num_draft_tokens": 0}))
    parts = grpc_generate(
        spec_server.grpc_url, fields | {"num_draft_tokens": 4, "speculation": "prompt_lookup", "stream": True}
    )
    assert ids_of(parts) == reference


def test_a_stop_word_ends_a_streamed_stretch_at_the_word(spec_server, references):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(spec_server.repo.parent / "engines" / "target"))  # the BLS's tokenizer
    # a token of the answer that is a word of its own: its text tokenizes back to it alone
    word = next(
        w
        for t in references[PROMPTS[0]][4:]
        if (w := tok.decode([t])).strip() and "\ufffd" not in w and tok(w, add_special_tokens=False)["input_ids"] == [t]
    )
    fields = {"text_input": PROMPTS[0], "max_tokens": 24, "stop_words": [word], "num_draft_tokens": 0}
    whole = text_of(grpc_generate(spec_server.grpc_url, fields))
    streamed = text_of(grpc_generate(spec_server.grpc_url, fields | {"stream": True}))
    assert streamed == whole[len(PROMPTS[0]) :] and streamed.endswith(word)


def test_a_cancelled_stream_stops_its_engine_call(spec_server):
    """The client leaves in the middle of a long plain stretch: the BLS stops the engine call (stop with the
    request's id), so the engine's slot is free long before the stretch would have ended."""
    from trtspec.client import SpecClient

    tokens = engine_metric(spec_server, "trtspec_engine_tokens_total")
    with SpecClient(spec_server.grpc_url, "grpc", timeout=120) as client:
        got = client.generate(PROMPTS[0], max_tokens=480, end_id=-1, num_draft_tokens=0, stream=True, stop_after_s=0.5)
    assert got.finish_reason == "cancelled" and 0 < len(got.token_ids) < 480
    deadline = time.monotonic() + 30
    while engine_metric(spec_server, "trtspec_engine_running_calls") > 0:
        assert time.monotonic() < deadline, "the engine call went on after the client left"
        time.sleep(0.05)
    spent = engine_metric(spec_server, "trtspec_engine_tokens_total") - tokens
    assert spent < 480, f"the stopped call still generated {spent} tokens"
    assert ids_of(grpc_generate(spec_server.grpc_url, {"text_input": PROMPTS[0], "max_tokens": 4}))  # still serving


def test_a_stop_request_needs_the_request_id(spec_server):
    """As TensorRT-LLM's handleStopRequest: "Trying to stop a request but request ID is not provided"."""
    client = grpcclient.InferenceServerClient(spec_server.grpc_url)
    responses: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        inputs = []
        for name, value in (
            ("input_ids", np.zeros((1, 1), np.int32)),
            ("input_lengths", np.zeros((1, 1), np.int32)),
            ("request_output_len", np.zeros((1, 1), np.int32)),
            ("stop", np.ones((1, 1), bool)),
        ):
            t = grpcclient.InferInput(name, list(value.shape), "BOOL" if value.dtype == bool else "INT32")
            t.set_data_from_numpy(value)
            inputs.append(t)
        client.async_stream_infer("tensorrt_llm", inputs)
        _, error = responses.get(timeout=60)
        assert error is not None and "request ID is not provided" in str(error)
        client.async_stream_infer("tensorrt_llm", inputs, request_id="nothing-runs-with-this-id")
        result, error = responses.get(timeout=60)
        assert error is None and not result.get_response().outputs  # an empty answer: nothing to stop is no error
    finally:
        client.stop_stream()
        client.close()


@pytest.fixture(scope="module")
def llama3_ends(tmp_path_factory):
    """A served pair whose target declares a second end token in generation_config.json, as Llama 3.x Instruct
    declares three: a token of the prompt's own greedy answer, so that the answer ends there."""
    from support.tiny import served_pair
    from transformers import AutoTokenizer

    from trtspec.config import load_config
    from trtspec.contract import GenerationRequest
    from trtspec.deploy.writer import write_repository
    from trtspec.engine.runtime import Engine, InProcessClient

    found = {}

    def write(config, engines, repo, overrides):
        target = engines / "target"
        tokenizer = AutoTokenizer.from_pretrained(str(target))
        prompt = tokenizer(PROMPTS[0])["input_ids"]
        answer = (
            InProcessClient(Engine.load(target))
            .generate(GenerationRequest(input_ids=prompt, request_output_len=24, end_id=-1))
            .new_tokens
        )
        declared = json.loads((target / "generation_config.json").read_text())
        other = next(t for t in answer[6:] if t != declared["eos_token_id"])
        declared["eos_token_id"] = [declared["eos_token_id"], other]
        (target / "generation_config.json").write_text(json.dumps(declared))
        found.update(
            prompt=prompt,
            answer=answer,
            other=other,
            eos=declared["eos_token_id"][0],
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        )
        return write_repository(load_config(config), engines, repo, overrides=overrides)

    server = served_pair(tmp_path_factory.mktemp("ends"), write=write)
    server.start(timeout=300)
    yield server, found
    server.stop()


def test_every_end_token_the_model_declares_ends_the_answer(llama3_ends):
    server, found = llama3_ends
    answer, other = found["answer"], found["other"]
    until = answer[: answer.index(other)]
    for fields in (
        {},
        {"num_draft_tokens": 0},
        {"stream": True},
        {"speculation": "draft_model", "num_draft_tokens": 3},
    ):
        out = grpc_generate(
            server.grpc_url, {"text_input": PROMPTS[0], "max_tokens": 24, "return_perf_metrics": True, **fields}
        )
        assert ids_of(out) == until, fields
        assert out[-1]["finish_reason"].reshape(-1)[0].decode() == "end_id"
    # the ensemble too: preprocessing sends the other end token as a stop word, which the engine returns
    req = urllib.request.Request(
        f"{server.http_base_url}/v2/models/ensemble/generate",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"text_input": PROMPTS[0], "max_tokens": 24}).encode(),
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        text = json.loads(resp.read())["text_output"]
    assert text == found["decode"](found["prompt"] + answer[: len(until) + 1])  # the prompt's text, then the answer
    # a client's own end_id is the only one: the answer runs on past the model's other end token
    out = grpc_generate(server.grpc_url, {"text_input": PROMPTS[0], "max_tokens": 24, "end_id": found["eos"]})
    assert ids_of(out) == answer[: answer.index(found["eos"])] if found["eos"] in answer else ids_of(out) == answer
