"""Generated requests to the speculative BLS, and how to send and judge them (used by tests/test_fuzz.py and
benchmarks/fuzz.py): every BLS input of trtspec.contract with valid, boundary and invalid values, values of the
wrong type, and unknown fields, over HTTP `/generate`, `/generate_stream` or gRPC streaming."""

from __future__ import annotations

import json
import math
import queue
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from trtspec.contract import BLS_INPUTS

BLS = "tensorrt_llm_bls"
SPECS = {t.name: t for t in BLS_INPUTS}
PROMPTS = ("The quick brown fox", "def add(a, b):", "Ünïcødé ☃ — text")
# fields that leave a greedy answer as it is: with only these, an answer must equal target-only output
OUTPUT_NEUTRAL = {
    "text_input",
    "max_tokens",
    "num_draft_tokens",
    "speculation",
    "adaptive_draft_length",
    "stream",
    "use_draft_logits",
    "return_perf_metrics",
    "final_perf_metrics_only",
    "timeout_ms",
    "return_log_probs",
    "return_context_logits",
    "return_generation_logits",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "length_penalty",
    "num_return_sequences",
    "beam_width",
    "decoder_text_input",
    "image_url_input",
    "prompt_vocab_size",
    "prompt_table_extra_id",
    "embedding_bias_words",
    "embedding_bias_weights",
    "lora_task_id",
    "guided_decoding_guide_type",
    "guided_decoding_guide",
}
TRANSPORTS = ("http", "http_stream", "grpc")

_ints = st.integers
_wrong = st.one_of(st.text(max_size=6), st.lists(st.integers(0, 5), max_size=3), st.floats(-10, 10, allow_nan=False))
_bool = st.one_of(st.booleans(), st.booleans(), _ints(0, 2), st.text(max_size=4))
_words = st.one_of(st.lists(st.text(max_size=8), max_size=3), st.text(max_size=8), _ints(-5, 5))

VALUES = {
    "text_input": st.one_of(
        st.sampled_from(PROMPTS),
        st.sampled_from(PROMPTS),
        st.text(max_size=60),
        st.just(""),
        st.just("word " * 200),
        _ints(-3, 3),
    ),
    "max_tokens": st.one_of(_ints(1, 8), _ints(1, 8), _ints(-2, 0), st.sampled_from([2**31 - 1, 10**6, 300]), _wrong),
    "num_draft_tokens": st.one_of(_ints(0, 4), _ints(0, 4), _ints(-3, 12), st.sampled_from([2**31 - 1]), _wrong),
    "use_draft_logits": _bool,
    "stream": _bool,
    "temperature": st.one_of(st.floats(0, 2), st.floats(-1, 5, allow_nan=False), st.just(0.0), _wrong),
    "top_k": st.one_of(_ints(0, 50), _ints(-3, 10**6), _wrong),
    "top_p": st.one_of(st.floats(0, 1), st.floats(-0.5, 1.5, allow_nan=False), _wrong),
    "seed": st.one_of(_ints(0, 2**63), _ints(-3, 0), _wrong),
    "end_id": st.one_of(_ints(-1, 300), _ints(-5, 10**7), _wrong),
    "pad_id": st.one_of(_ints(-1, 300), _ints(-5, 10**7), _wrong),
    "min_tokens": st.one_of(_ints(0, 8), _ints(-3, 10**4), _wrong),
    "stop_words": _words,
    "bad_words": _words,
    "return_perf_metrics": _bool,
    "final_perf_metrics_only": _bool,
    "exclude_input_in_output": _bool,
    "speculation": st.one_of(st.sampled_from(["draft_model", "prompt_lookup", "none", "bogus", ""]), _ints(0, 3)),
    "adaptive_draft_length": _bool,
    "timeout_ms": st.one_of(st.just(60000), _ints(0, 10**6), _ints(-5, -1), _wrong),
    "repetition_penalty": st.one_of(st.floats(0.5, 2), st.floats(-1, 3, allow_nan=False), st.just(0.0), _wrong),
    "presence_penalty": st.one_of(st.floats(-2, 2), _wrong),
    "frequency_penalty": st.one_of(st.floats(-2, 2), _wrong),
    "length_penalty": st.one_of(st.floats(-2, 2), _wrong),
    "return_log_probs": _bool,
    "return_context_logits": _bool,
    "return_generation_logits": _bool,
    "return_num_input_tokens": _bool,
    "return_num_output_tokens": _bool,
    "num_return_sequences": st.one_of(st.just(1), _ints(-2, 4), _wrong),
    "beam_width": st.one_of(st.just(1), _ints(-2, 4), _wrong),
    # taken only at their neutral value (trtspec.interfaces): empty, zero, or refused naming the field
    "decoder_text_input": st.one_of(st.just(""), st.text(max_size=8)),
    "image_url_input": st.one_of(st.just(""), st.text(max_size=8)),
    "prompt_vocab_size": st.one_of(st.just(0), _ints(-2, 10)),
    "prompt_table_extra_id": _ints(0, 5),
    "embedding_bias_words": _words,
    "embedding_bias_weights": st.one_of(st.just([]), st.lists(st.floats(-1, 1), max_size=3)),
    "lora_task_id": _ints(0, 5),
    "guided_decoding_guide_type": st.one_of(st.just(""), st.sampled_from(["json", "regex"])),
    "guided_decoding_guide": st.one_of(st.just(""), st.text(max_size=8)),
    "store": _bool,
    "stream_interval": st.one_of(_ints(0, 4), _ints(-3, 10**6), _wrong),
    "prediction": st.one_of(st.sampled_from(PROMPTS), st.text(max_size=60), st.just(""), _ints(-3, 3)),
    "prompt_ignore_length": st.one_of(_ints(-3, 2**31 - 1), _wrong),
}
# inputs of more than one dimension (images, prompt tables, LoRA weights) have no JSON form in Triton's generate
# extension; tests/test_nvidia_clients.py sends them over gRPC
UNFUZZED = {t.name for t in BLS_INPUTS if len(t.dims) > 1 or t.dims == (-1, 2)}
assert set(VALUES) == set(SPECS) - UNFUZZED, "every BLS input is fuzzed"
# values a request may carry and still get an answer (so that answers, and their equality with target-only
# output, are fuzzed as much as the errors)
VALID = {
    "text_input": st.sampled_from(PROMPTS),
    "max_tokens": _ints(1, 8),
    "num_draft_tokens": _ints(0, 4),
    "use_draft_logits": st.booleans(),
    "stream": st.booleans(),
    "temperature": st.sampled_from([0.0, 0.7, 1.3]),
    "top_k": _ints(0, 40),
    "top_p": st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    "seed": _ints(0, 2**32),
    "end_id": _ints(-1, 200),
    "pad_id": _ints(0, 200),
    "min_tokens": _ints(0, 4),
    "stop_words": st.lists(st.sampled_from(["fox", ".", "\n"]), max_size=2),
    "bad_words": st.just([]),
    "return_perf_metrics": st.booleans(),
    "final_perf_metrics_only": st.booleans(),
    "exclude_input_in_output": st.booleans(),
    "speculation": st.sampled_from(["draft_model", "prompt_lookup", "none"]),
    "adaptive_draft_length": st.booleans(),
    "timeout_ms": st.just(60000),
    "repetition_penalty": st.sampled_from([1.0, 1.2]),
    "presence_penalty": st.sampled_from([0.0, 0.5]),
    "frequency_penalty": st.sampled_from([0.0, 0.3]),
    "length_penalty": st.just(1.0),
    "prompt_ignore_length": st.sampled_from([0, 3, 2**31 - 1]),
    "return_log_probs": st.booleans(),
    "return_context_logits": st.booleans(),
    "return_generation_logits": st.booleans(),
    "return_num_input_tokens": st.booleans(),
    "return_num_output_tokens": st.booleans(),
    "num_return_sequences": st.just(1),
    "beam_width": st.just(1),
    "decoder_text_input": st.just(""),
    "image_url_input": st.just(""),
    "prompt_vocab_size": st.just(0),
    "prompt_table_extra_id": st.just(0),
    "embedding_bias_words": st.just([]),
    "embedding_bias_weights": st.just([]),
    "lora_task_id": st.just(0),
    "guided_decoding_guide_type": st.just(""),
    "guided_decoding_guide": st.just(""),
    "store": st.booleans(),
    "stream_interval": _ints(0, 4),
    "prediction": st.one_of(st.sampled_from(PROMPTS), st.just("")),
}
assert set(VALID) == set(VALUES), "every fuzzed input has valid values"


@st.composite
def bls_requests(draw):
    """(transport, fields): the two required fields most of the time, any others, sometimes an unknown one."""
    fields = {}
    values = VALID if draw(st.booleans()) else VALUES
    for name in VALUES:
        required = name in ("text_input", "max_tokens")
        if draw(st.floats(0, 1)) < (0.93 if required else 0.2):
            fields[name] = draw(values[name])
    if draw(st.floats(0, 1)) < 0.05:
        fields[draw(st.sampled_from(["max_new_tokens", "prompt", "n"]))] = draw(_ints(0, 3))
    return draw(st.sampled_from(TRANSPORTS)), fields


@dataclass
class Outcome:
    ANSWER, FIELD_ERROR, OTHER_ERROR = "answer", "error naming a field", "other error"
    # Triton's generate extension converts JSON to tensors before any model sees the request, and refuses a JSON
    # value of the wrong type with "Unable to parse 'data': ..." or "Unable to parse JSON bytes array: ..."
    # (tritonserver 2.51), naming no field
    JSON_TYPE_ERROR = "JSON type refused by Triton's generate extension"
    kind: str
    ids: list[int] = field(default_factory=list)
    detail: str = ""

    @classmethod
    def classify_error(cls, message: str, fields: dict) -> str:
        if message.startswith("Unable to parse"):
            return cls.JSON_TYPE_ERROR
        names = set(fields) | set(SPECS)
        return (
            cls.FIELD_ERROR
            if any(
                f"'{n}'" in message
                or f"{n} " in message
                or f"{n}:" in message
                or f"{n}=" in message
                or f'"{n}"' in message
                for n in names
            )
            else cls.OTHER_ERROR
        )


def wrong_json_type(fields: dict) -> bool:
    """Whether some value's JSON type is not its field's (what Triton's generate extension refuses itself)."""
    for name, value in fields.items():
        spec = SPECS.get(name)
        if spec is None:
            continue
        kinds = {
            "STRING": (str,),
            "BOOL": (bool,),
            "FP32": (int, float),
            "FP16": (int, float),
            "INT32": (int,),
            "INT64": (int,),
            "UINT64": (int,),
            "UINT8": (int,),
        }[spec.dtype]
        values = value if isinstance(value, list) and spec.dims == (-1,) else [value]
        if any(not isinstance(v, kinds) or (spec.dtype != "BOOL" and isinstance(v, bool)) for v in values):
            return True
        if spec.dtype in ("INT32", "INT64", "UINT64"):  # an integer out of the type's range is refused the same way
            info = np.iinfo(spec.np_dtype)
            if any(not info.min <= v <= info.max for v in values):
                return True
    return False


def send(server, transport: str, fields: dict, timeout: float = 120.0) -> Outcome:
    try:
        if transport == "grpc":
            return _grpc(server.grpc_url, fields, timeout)
        return _http(server.http_base_url, fields, transport == "http_stream", timeout)
    except _Failed as exc:
        return Outcome(Outcome.classify_error(str(exc), fields), detail=str(exc))


class _Failed(Exception):
    pass


def _http(base: str, fields: dict, stream: bool, timeout: float) -> Outcome:
    path = "generate_stream" if stream else "generate"
    body = json.dumps(fields).encode()
    req = urllib.request.Request(
        f"{base}/v2/models/{BLS}/{path}", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text = resp.read().decode()
    except urllib.error.HTTPError as exc:  # a JSON error, or for a stream one server-sent event holding it
        text = exc.read().decode().strip()
        text = text[5:] if text.startswith("data:") else text
        raise _Failed(json.loads(text or "{}").get("error", f"HTTP {exc.code}")) from None
    events = (
        [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
        if stream
        else [json.loads(text)]
    )
    errors = [e["error"] for e in events if "error" in e]
    if errors:
        raise _Failed(errors[0])
    return Outcome(Outcome.ANSWER, [int(t) for e in events for t in np.asarray(e.get("output_ids", [])).reshape(-1)])


def _tensor(grpcclient, name: str, value):
    """A gRPC input holding `value` as the field's own dtype where it fits, else as what the value is (which
    the server must refuse by name)."""
    spec = SPECS.get(name)
    values = value if isinstance(value, list) else [value]
    if spec is not None and spec.dtype == "STRING" or any(isinstance(v, str) for v in values) or not values:
        arr = np.asarray([[str(v).encode() for v in values] or [b""]], dtype=np.object_)
        dtype = "BYTES"
    elif all(isinstance(v, bool) for v in values):
        arr, dtype = np.asarray([values], dtype=np.bool_), "BOOL"
    elif all(isinstance(v, int) for v in values):
        target = spec.np_dtype if spec is not None and spec.dtype in ("INT32", "INT64", "UINT64") else np.int64
        info = np.iinfo(target)
        if all(info.min <= v <= info.max for v in values):
            arr, dtype = (
                np.asarray([values], dtype=target),
                spec.dtype if spec is not None and spec.dtype in ("INT32", "INT64", "UINT64") else "INT64",
            )
        else:
            arr, dtype = np.asarray([[str(v).encode() for v in values]], dtype=np.object_), "BYTES"
    else:
        arr, dtype = np.asarray([[float(v) for v in values]], dtype=np.float32), "FP32"
    tensor = grpcclient.InferInput(name, list(arr.shape), dtype)
    tensor.set_data_from_numpy(arr)
    return tensor


def _grpc(url: str, fields: dict, timeout: float) -> Outcome:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        try:
            inputs = [_tensor(grpcclient, name, value) for name, value in fields.items()]
        except (OverflowError, ValueError) as exc:  # a value numpy cannot hold: not a request anyone can send
            return Outcome(Outcome.FIELD_ERROR, detail=f"client side: {exc}")
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(BLS, inputs, enable_empty_final_response=True)
        ids = []
        while True:
            result, error = responses.get(timeout=timeout)
            if error is not None:
                raise _Failed(error.message() if isinstance(error, InferenceServerException) else str(error))
            names = [o.name for o in result.get_response().outputs]
            if "output_ids" in names:
                ids += [int(t) for t in result.as_numpy("output_ids").reshape(-1)]
            if result.get_response().parameters["triton_final_response"].bool_param:
                return Outcome(Outcome.ANSWER, ids)
    finally:
        client.stop_stream()
        client.close()


def is_nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)
