"""Clients for a trtspec (or NVIDIA tensorrtllm_backend) deployment: generate, engine logits, metrics.

`SpecClient` talks to the decoupled `tensorrt_llm_bls` model over HTTP or gRPC:

- gRPC: the bidirectional stream (`start_stream` + `async_stream_infer`, with an empty final response), for
  `stream` true and false alike, since a decoupled model answers only on a stream;
- HTTP: Triton's generate extension (`POST /v2/models/<m>/generate`, and `/generate_stream` as server-sent
  events when `stream` is true), with the standard library and JSON: each request field becomes the input
  tensor of that name. (tritonclient.http cannot talk to decoupled models.)

`engine_logits`, `tokenize` and `detokenize` call `tensorrt_llm`, `preprocessing` and `postprocessing` with one
request each (`infer`: tritonclient's plain infer, or a gRPC stream for a decoupled model, as the engine models are
by default). `metrics` reads the trtspec_* counters from Triton's Prometheus endpoint. What a generation request
sends, and the Completion its responses make, is trtspec.generation (free of any transport).

A client holds at most one tritonclient connection per protocol and closes it in `close()` (or on leaving a
`with` block): an open keep-alive connection would hold up the server's shutdown. An HTTP generate request
uses its own connection, closed when the response ends. One SpecClient runs one request at a time; use one
client per thread for concurrent requests.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import queue
import re
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterable

import numpy as np

from trtspec import keys
from trtspec.contract import BLS_INPUTS, ENGINE_INPUTS
from trtspec.errors import TrtspecError
from trtspec.generation import Chunk, Collector, Completion, as_text, request_fields

DEFAULT_PORTS = {"http": 8000, "grpc": 8001}
METRICS_PORT = 8002
PROTOCOLS = ("http", "grpc")
_BLS_DTYPES = {t.name: t.dtype for t in BLS_INPUTS}
_ENGINE_DTYPES = {t.name: t.dtype for t in ENGINE_INPUTS}


class ClientError(TrtspecError):
    """A request the server refused or failed (its own message), or a server that cannot be reached."""


# ---- pure helpers (tested without a server) ------------------------------------------------------------------


def default_url(protocol: str, host: str = "127.0.0.1") -> str:
    return f"{host}:{DEFAULT_PORTS[protocol]}"


def split_url(url: str, default_port: int) -> tuple[str, str, int]:
    """`url` ("host:port", "http://host:port/", "[::1]:8000", "grpc://host") -> (scheme, host, port)."""
    if "://" not in url:
        url = "//" + url
    parts = urllib.parse.urlsplit(url)
    if not parts.hostname:
        raise ClientError(f"cannot read a host from the URL '{url.lstrip('/')}'; give host:port, e.g. 127.0.0.1:8000")
    try:
        port = parts.port or default_port
    except ValueError as exc:
        raise ClientError(f"bad port in the URL '{url.lstrip('/')}': {exc}") from None
    return parts.scheme or "http", parts.hostname, port


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def parse_prometheus(text: str, prefix: str = "trtspec_") -> dict[str, float]:
    """Prometheus text exposition -> {name: sum over its label sets, 'name{k="v",...}': value of that set}.

    Only samples whose name starts with `prefix`; labels are written sorted by name, so keys are stable."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None or not m.group(1).startswith(prefix):
            continue
        name, labels, raw = m.group(1), m.group(3), m.group(4)
        try:
            value = float(raw)
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
        if labels and labels.strip():
            pairs = sorted(_LABEL.findall(labels))
            key = name + "{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}"
            out[key] = out.get(key, 0.0) + value
    return out


def fetch_metrics(metrics_url: str, prefix: str = "trtspec_", timeout: float = 10.0) -> dict[str, float]:
    """GET Triton's metrics endpoint (`http://host:8002/metrics`) and parse the `prefix` samples."""
    if "://" not in metrics_url:
        metrics_url = "http://" + metrics_url
    if urllib.parse.urlsplit(metrics_url).path in ("", "/"):
        metrics_url = metrics_url.rstrip("/") + "/metrics"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback must not go via a proxy
    try:
        with opener.open(metrics_url, timeout=timeout) as resp:
            return parse_prometheus(resp.read().decode("utf-8", "replace"), prefix)
    except (OSError, http.client.HTTPException) as exc:
        raise ClientError(f"cannot read metrics from {metrics_url}: {exc}") from exc


# ---- the client -------------------------------------------------------------------------------------------------


class SpecClient:
    """A client of one deployment. `url`: "host:port" of the protocol's endpoint (HTTP 8000, gRPC 8001).

    `timeout`: seconds a request may take in all (generate) or per network operation (other calls); a request
    past it raises ClientError (over gRPC the server is also told to cancel it). `headers`: sent with every request
    (HTTP headers, gRPC metadata): the keys a deployment's restricted APIs ask for [default: those in
    $TRTSPEC_ADMIN_KEY and $TRTSPEC_API_KEY, or of the server at `url` that this process started:
    trtspec.keys.client_headers]."""

    def __init__(
        self,
        url: str | None = None,
        protocol: str = "http",
        model: str = "tensorrt_llm_bls",
        timeout: float = 600.0,
        headers: dict[str, str] | None = None,
    ):
        if protocol not in PROTOCOLS:
            raise ClientError(f"protocol must be one of {', '.join(PROTOCOLS)}, got '{protocol}'")
        self.protocol = protocol
        self.model = model
        self.timeout = timeout
        self.scheme, self.host, self.port = split_url(url or default_url(protocol), DEFAULT_PORTS[protocol])
        if protocol == "http" and self.scheme not in ("http", "https"):
            raise ClientError(f"an HTTP URL must be http:// or https://, got '{url}'")
        self.url = _hostport(self.host, self.port)
        given = keys.client_headers(self.url) if headers is None else dict(headers)
        # Triton's gRPC front reads a restricted protocol's key from metadata named with this prefix
        self.headers = {keys.GRPC_PREFIX + k: v for k, v in given.items()} if protocol == "grpc" else given
        self._tc = None  # tritonclient module of the protocol
        self._client = None  # its InferenceServerClient, made on first use
        self._lock = threading.Lock()
        self._batched: dict[str, bool] = {}
        self._decoupled: dict[str, bool] = {}

    # lifecycle
    def __enter__(self) -> SpecClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                if self.protocol == "grpc":
                    client.stop_stream()
                client.close()
            except Exception:  # closing must never mask the caller's own error
                pass

    def _triton(self):
        """The tritonclient InferenceServerClient of this client's protocol (made on first use)."""
        if self._client is None:
            if self.protocol == "grpc":
                import tritonclient.grpc as tc

                keep = tc.KeepAliveOptions()
                options = [
                    ("grpc.max_send_message_length", 2**31 - 1),
                    ("grpc.max_receive_message_length", 2**31 - 1),
                    ("grpc.keepalive_time_ms", keep.keepalive_time_ms),
                    ("grpc.keepalive_timeout_ms", keep.keepalive_timeout_ms),
                    ("grpc.keepalive_permit_without_calls", keep.keepalive_permit_without_calls),
                    ("grpc.http2.max_pings_without_data", keep.http2_max_pings_without_data),
                    ("grpc.enable_http_proxy", 0),  # a loopback server must not be reached through http_proxy
                ]
                self._client = tc.InferenceServerClient(self.url, channel_args=options)
            else:
                import tritonclient.http as tc

                self._client = tc.InferenceServerClient(
                    self.url, ssl=self.scheme == "https", connection_timeout=self.timeout, network_timeout=self.timeout
                )
            self._tc = tc
        return self._client

    def _send(self, responses: queue.Queue, send: Callable[[], None], what: str) -> None:
        """Send a request on the gRPC stream. A stream the server refused at once (a restricted protocol, say) makes
        tritonclient raise a generic error here and hand the server's reason to the callback: raise with that."""
        try:
            send()
        except Exception as exc:
            try:
                *_, error = responses.get(timeout=1.0)
            except queue.Empty:
                error = None
            raise self._error(error or exc, what) from exc

    def _error(self, exc: Exception, what: str) -> ClientError:
        message = exc.message() if hasattr(exc, "message") and callable(exc.message) else str(exc)
        return self.server_error(what, message)

    def server_error(self, what: str, message: str) -> ClientError:
        """`what (protocol url): message`, without repeating `what` when the server's message starts with it."""
        message = str(message)
        if message.startswith(f"{what}:"):
            what, message = message.split(":", 1)
            message = message.lstrip()
        return ClientError(f"{what} ({self.protocol} {self.url}): {message}")

    def model_config(self, model: str) -> dict:
        try:
            if self.protocol == "grpc":
                return self._triton().get_model_config(
                    model, headers=self.headers, as_json=True, client_timeout=self.timeout
                )["config"]
            return self._triton().get_model_config(model, headers=self.headers)
        except Exception as exc:
            error = self._error(exc, f"cannot read the config of model '{model}'")
            if keys.ADMIN_HEADER in str(error):  # Triton: "This API is restricted, expecting header ..."
                raise ClientError(
                    f"{error}. The deployment's model configs answer only to its admin key: set {keys.ADMIN_ENV} to "
                    "it (`trtspec serve` prints the file that holds it)"
                ) from exc
            raise error from exc

    def is_batched(self, model: str) -> bool:
        """Whether `model` has a batch dim (max_batch_size > 0): its tensors then go as [1, ...]."""
        if model not in self._batched:
            self._batched[model] = int(self.model_config(model).get("max_batch_size", 0) or 0) > 0
        return self._batched[model]

    # generate
    def generate(
        self,
        prompt: str,
        *,
        max_tokens: int,
        num_draft_tokens: int | None = None,
        use_draft_logits: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop_words: Iterable[str] | None = None,
        end_id: int | None = None,
        min_tokens: int | None = None,
        return_perf_metrics: bool = True,
        stream: bool = False,
        on_chunk: Callable[[Chunk], None] | None = None,
        stop_after_s: float | None = None,
        speculation: str | None = None,
        adaptive_draft_length: bool | None = None,
        final_perf_metrics_only: bool | None = None,
        **more,
    ) -> Completion:
        """Generate from `prompt` with the BLS; None leaves a field to the deployment's default.

        `stream`: the BLS sends one response per iteration (each passed to `on_chunk` as it arrives) instead
        of one at the end. `stop_after_s`: give up after that many seconds and return what arrived, with
        finish_reason "cancelled"; the request is cancelled (gRPC: stop_stream(cancel_requests=True); HTTP: the
        connection is closed, on which Triton cancels it). `end_id` -1: no end token (generate max_tokens);
        `min_tokens`: no end before that many. `speculation` (trtspec.interfaces.SPECULATION_METHODS),
        `adaptive_draft_length` (false: draft exactly num_draft_tokens each iteration) and `final_perf_metrics_only`
        (a streamed request's perf metrics with its last response alone) go to deployments that have those inputs;
        None leaves them out.
        """
        fields = request_fields(
            prompt,
            max_tokens=max_tokens,
            num_draft_tokens=num_draft_tokens,
            use_draft_logits=use_draft_logits,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop_words=stop_words,
            end_id=end_id,
            min_tokens=min_tokens,
            return_perf_metrics=return_perf_metrics,
            stream=stream,
            speculation=speculation,
            adaptive_draft_length=adaptive_draft_length,
            final_perf_metrics_only=final_perf_metrics_only,
            **more,  # other BLS inputs by name (prediction, return_log_probs, ...)
        )
        with self._lock:
            if self.protocol == "grpc":
                return self._generate_grpc(fields, on_chunk, stop_after_s)
            return self._generate_http(fields, stream, on_chunk, stop_after_s)

    def _generate_grpc(self, fields: dict, on_chunk, stop_after_s: float | None) -> Completion:
        client = self._triton()
        tc = self._tc
        batched = self.is_batched(self.model)
        inputs = []
        for name, value in fields.items():
            dtype = _BLS_DTYPES.get(name)
            if dtype is None:
                raise ClientError(f"'{name}' is not an input of tensorrt_llm_bls")
            inputs.append(_infer_input(tc, name, value, dtype, batched))
        responses: queue.Queue = queue.Queue()
        client.start_stream(
            callback=lambda result, error: responses.put((time.perf_counter(), result, error)), headers=self.headers
        )
        finished = False
        try:
            sent_at = time.perf_counter()
            collector = Collector(sent_at, on_chunk)
            self._send(
                responses,
                lambda: client.async_stream_infer(
                    self.model, inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True
                ),
                self.model,
            )
            deadline = sent_at + self.timeout
            stop_at = sent_at + stop_after_s if stop_after_s is not None else None
            while True:
                wait_until = deadline if stop_at is None else min(deadline, stop_at)
                try:
                    arrived_at, result, error = responses.get(timeout=max(wait_until - time.perf_counter(), 0.0))
                except queue.Empty:
                    if stop_at is not None and time.perf_counter() >= stop_at:
                        return collector.finish(time.perf_counter(), reason="cancelled")
                    raise ClientError(
                        f"{self.model} gave no final response within {self.timeout:g} s "
                        f"(grpc {self.url}); the request was cancelled"
                    ) from None
                if error is not None:
                    finished = True  # an error response is final
                    raise self._error(error, self.model)
                response = result.get_response()
                outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
                collector.add(arrived_at, outputs)
                final = response.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    finished = True
                    return collector.finish(arrived_at)
        finally:
            try:
                client.stop_stream(cancel_requests=not finished)
            except Exception:
                pass

    def _generate_http(self, fields: dict, stream: bool, on_chunk, stop_after_s: float | None) -> Completion:
        path = f"/v2/models/{urllib.parse.quote(self.model)}/generate" + ("_stream" if stream else "")
        body = json.dumps(fields).encode()
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.timeout)
        sent_at = time.perf_counter()
        deadline = sent_at + self.timeout
        stop_at = sent_at + stop_after_s if stop_after_s is not None else None
        collector = Collector(sent_at, on_chunk)

        def next_read_timeout() -> None:
            # Every read waits at most until the deadline or the stop time, whichever comes first.
            until = deadline if stop_at is None else min(deadline, stop_at)
            if conn.sock is not None:
                conn.sock.settimeout(max(until - time.perf_counter(), 1e-3))

        try:
            conn.request(
                "POST", path, body, {**self.headers, "Content-Type": "application/json", "Connection": "close"}
            )
            next_read_timeout()
            resp = conn.getresponse()
            if resp.status != 200:
                raise self.server_error(self.model, http_error_message(resp.status, resp.reason, resp.read()))
            if not stream:
                collector.add(time.perf_counter(), parse_event(resp.read().decode("utf-8", "replace"), self))
                return collector.finish(time.perf_counter())
            for data in _sse_events(resp, before_read=next_read_timeout):
                collector.add(time.perf_counter(), parse_event(data, self))
                if stop_at is not None and time.perf_counter() >= stop_at:
                    break
            else:
                return collector.finish(time.perf_counter())
            return collector.finish(time.perf_counter(), reason="cancelled")  # closing the connection cancels it
        except TimeoutError as exc:
            if stop_at is not None and time.perf_counter() >= stop_at:
                return collector.finish(time.perf_counter(), reason="cancelled")
            raise ClientError(
                f"{self.model} did not finish within {self.timeout:g} s (http {self.url}); "
                "the connection was closed, which cancels the request"
            ) from exc
        except (OSError, http.client.HTTPException) as exc:
            raise ClientError(f"{self.model} (http {self.url}): {type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()

    # one request, one answer
    def is_decoupled(self, model: str) -> bool:
        if model not in self._decoupled:
            policy = self.model_config(model).get("model_transaction_policy") or {}
            self._decoupled[model] = bool(policy.get("decoupled", False))
        return self._decoupled[model]

    def infer(
        self, model: str, tensors: dict[str, np.ndarray], outputs: Iterable[str] | None = None
    ) -> dict[str, np.ndarray]:
        """One request to `model`, its outputs merged over its responses; tensors go as given (shapes included).
        `outputs`: the outputs to ask for; None asks for none by name and returns every output the model sent.
        A decoupled model (the engine models by default) is called over a gRPC stream, which only gRPC has."""
        if self.is_decoupled(model):
            if self.protocol != "grpc":
                raise ClientError(
                    f"'{model}' is decoupled, and Triton serves decoupled models over gRPC streams "
                    "only; use --protocol grpc (and the gRPC port)"
                )
            return self._infer_stream(model, tensors, outputs)
        client = self._triton()
        inputs, wanted = self._request_tensors(tensors, outputs)
        try:
            if self.protocol == "grpc":
                result = client.infer(model, inputs, outputs=wanted, client_timeout=self.timeout, headers=self.headers)
            else:
                result = client.infer(model, inputs, outputs=wanted, headers=self.headers)
        except Exception as exc:
            raise self._error(exc, model) from exc
        names = (
            [o.name for o in result.get_response().outputs]
            if self.protocol == "grpc"
            else [o["name"] for o in result.get_response().get("outputs", [])]
        )
        return {name: result.as_numpy(name) for name in names}

    def _request_tensors(self, tensors: dict[str, np.ndarray], outputs: Iterable[str] | None):
        """tritonclient's inputs (shapes and dtypes as given) and requested outputs (None: every one)."""
        tc, inputs = self._tc, []
        for name, value in tensors.items():
            arr = np.asarray(value)
            inp = tc.InferInput(name, list(arr.shape), _triton_dtype(arr))
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        return inputs, None if outputs is None else [tc.InferRequestedOutput(n) for n in outputs]

    def _infer_stream(
        self, model: str, tensors: dict[str, np.ndarray], outputs: Iterable[str] | None
    ) -> dict[str, np.ndarray]:
        client = self._triton()
        inputs, wanted = self._request_tensors(tensors, outputs)
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)), headers=self.headers)
        merged: dict[str, np.ndarray] = {}
        try:
            self._send(
                responses,
                lambda: client.async_stream_infer(
                    model, inputs, outputs=wanted, request_id=uuid.uuid4().hex, enable_empty_final_response=True
                ),
                model,
            )
            while True:
                try:
                    result, error = responses.get(timeout=self.timeout)
                except queue.Empty:
                    raise ClientError(
                        f"{model} gave no final response within {self.timeout:g} s (grpc {self.url})"
                    ) from None
                if error is not None:
                    raise self._error(error, model)
                response = result.get_response()
                merged.update({o.name: result.as_numpy(o.name) for o in response.outputs})
                final = response.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    return merged
        finally:
            with contextlib.suppress(Exception):
                client.stop_stream()

    def engine_logits(self, sequence_ids: list[int], model: str = "tensorrt_llm") -> np.ndarray:
        """The engine's logits [V] for the token after `sequence_ids` (one greedy step, generation logits on).

        A TRT-LLM engine returns them only when built with --gather_generation_logits."""
        if not sequence_ids:
            raise ClientError("engine_logits needs at least one token id")
        batched = self.is_batched(model)

        def t(name, value):
            arr = np.asarray(value, dtype=_np_dtype(_ENGINE_DTYPES[name]))
            return arr[None] if batched else arr

        tensors = {
            "input_ids": t("input_ids", list(sequence_ids)),
            "input_lengths": t("input_lengths", [len(sequence_ids)]),
            "request_output_len": t("request_output_len", [1]),
            "return_generation_logits": t("return_generation_logits", [True]),
        }
        out = self.infer(model, tensors, ["generation_logits"])["generation_logits"]
        if out is None or out.size == 0:
            raise ClientError(
                f"{model} returned no generation_logits; a TRT-LLM engine must be built with "
                "--gather_generation_logits to return them"
            )
        return np.asarray(out, dtype=np.float32).reshape(-1, out.shape[-1])[0]

    def tokenize(self, text: str, model: str = "preprocessing") -> tuple[list[int], int | None]:
        """`text` -> (token ids, end id) with the deployment's `preprocessing` model (stock tensor names)."""
        batched = self.is_batched(model)
        query = np.asarray([[text.encode()]] if batched else [text.encode()], dtype=np.object_)
        out_len = np.asarray([[1]] if batched else [1], dtype=np.int32)
        out = self.infer(
            model, {"QUERY": query, "REQUEST_OUTPUT_LEN": out_len}, ["INPUT_ID", "REQUEST_INPUT_LEN", "OUT_END_ID"]
        )
        length = int(np.asarray(out["REQUEST_INPUT_LEN"]).reshape(-1)[0])
        ids = np.asarray(out["INPUT_ID"]).reshape(-1)[:length].astype(int).tolist()
        end = out.get("OUT_END_ID")
        end_id = int(np.asarray(end).reshape(-1)[0]) if end is not None and np.asarray(end).size else None
        return ids, (None if end_id is None or end_id < 0 else end_id)

    def detokenize(self, token_ids: list[int], model: str = "postprocessing") -> str:
        """Token ids -> text with the deployment's `postprocessing` model (stock tensor names)."""
        batched = self.is_batched(model)
        tokens = np.asarray([list(token_ids)], dtype=np.int32)  # [beam, len]
        length = np.asarray([len(token_ids)], dtype=np.int32)  # [beam]
        if batched:
            tokens, length = tokens[None], length[None]
        out = self.infer(model, {"TOKENS_BATCH": tokens, "SEQUENCE_LENGTH": length}, ["OUTPUT"])["OUTPUT"]
        return as_text(np.asarray(out).reshape(-1)[:1])

    def metrics(self, metrics_url: str | None = None, prefix: str = "trtspec_") -> dict[str, float]:
        """The server's `prefix` metrics (default URL: this client's host, port 8002)."""
        return fetch_metrics(
            metrics_url or f"http://{_hostport(self.host, METRICS_PORT)}/metrics",
            prefix,
            timeout=min(self.timeout, 30.0),
        )


# ---- wire helpers -------------------------------------------------------------------------------------------------

_NP_DTYPES = {
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT64": np.uint64,
    "FP32": np.float32,
    "BOOL": np.bool_,
    "STRING": np.object_,
}


def _np_dtype(triton_dtype: str):
    return _NP_DTYPES[triton_dtype]


def _triton_dtype(arr: np.ndarray) -> str:
    if arr.dtype == np.object_ or arr.dtype.kind in "SU":
        return "BYTES"
    return {
        np.dtype(np.int32): "INT32",
        np.dtype(np.int64): "INT64",
        np.dtype(np.uint64): "UINT64",
        np.dtype(np.float32): "FP32",
        np.dtype(np.bool_): "BOOL",
    }[arr.dtype]


def _infer_input(tc, name: str, value, dtype: str, batched: bool):
    values = value if isinstance(value, list) else [value]
    if dtype == "STRING":
        arr = np.asarray([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_)
    else:
        arr = np.asarray(values, dtype=_np_dtype(dtype))
    if batched:
        arr = arr[None]
    inp = tc.InferInput(name, list(arr.shape), "BYTES" if dtype == "STRING" else dtype)
    inp.set_data_from_numpy(arr)
    return inp


def http_error_message(status: int, reason: str, body: bytes) -> str:
    """The server's message from an error response: JSON, or (generate_stream) an event holding JSON."""
    raw = body.decode("utf-8", "replace").strip()
    body = "\n".join(line[5:].lstrip() for line in raw.splitlines() if line.startswith("data:")) or raw
    try:
        return json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status} {reason}: {raw[:500]}"


def parse_event(data: str, client: SpecClient) -> dict:
    try:
        obj = json.loads(data)
    except ValueError as exc:
        raise ClientError(
            f"{client.model} (http {client.url}) sent a response that is not JSON: {data[:200]!r}"
        ) from exc
    if isinstance(obj, dict) and "error" in obj:
        raise client.server_error(client.model, obj["error"])
    return obj


def _sse_events(resp, before_read: Callable[[], None] | None = None) -> Iterable[str]:
    """The `data:` payloads of a server-sent-event stream, one per event."""
    data: list[str] = []
    while True:
        if before_read is not None:
            before_read()
        raw = resp.readline()
        if not raw:
            break
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    if data:
        yield "\n".join(data)
