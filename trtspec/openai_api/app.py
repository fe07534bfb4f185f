"""The OpenAI-compatible HTTP front: a Starlette app over a deployment's `tensorrt_llm_bls`, run by uvicorn.

The front reads the BLS through Triton's HTTP generate endpoints in its own event loop (trtspec.openai_api.upstream),
so a streamed token passes no thread on its way from Triton to the client. Only the tokenizer's work (the chat
template, counting prompt tokens) runs on worker threads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from trtspec.client import ClientError, SpecClient
from trtspec.control import is_loopback
from trtspec.errors import TrtspecError
from trtspec.field_metrics import SPEC_DECODE_METRICS_LEVELS, spec_decode_summary
from trtspec.generation import Completion, request_fields
from trtspec.keys import API_ENV, Key
from trtspec.openai_api.errors import APIError, bls_error
from trtspec.openai_api.guard import AnswerFailures, RequireKey, http_protocol, read_body
from trtspec.openai_api.limits import Limits
from trtspec.openai_api.liveness import Liveness
from trtspec.openai_api.protocol import CHAT, COMPLETION, Request, parse_request
from trtspec.openai_api.responses import Chunks, finish_reason, response
from trtspec.openai_api.stops import StopText
from trtspec.openai_api.upstream import Upstream

log = logging.getLogger("trtspec.openai")
BLS = "tensorrt_llm_bls"


class FrontError(TrtspecError):
    """The front cannot start: Triton unreachable, no BLS, no tokenizer."""


def _parameter(config: dict, key: str) -> str | None:
    value = (config.get("parameters", {}).get(key) or {}).get("string_value", "")
    return None if value == "" or value.startswith("${") else value  # an unfilled template field is unset


def _number(config: dict, key: str) -> int | None:
    value = _parameter(config, key)
    return int(value) if value and value.isdigit() and int(value) > 0 else None


def served_name_for(tokenizer_dir: str) -> str:
    """The default model id: the tokenizer dir's name, or for trtspec's `engines/<name>/target` layout, <name>."""
    path = Path(tokenizer_dir.rstrip("/"))
    return path.parent.name if path.name == "target" and path.parent.name not in ("", "engines") else path.name


class Deployment:
    """What the front knows of one deployment: the BLS's tokenizer and limits, and the BLS to call
    (`triton_url`: Triton's HTTP host:port).

    `triton_headers`: sent with every request to Triton (`trtspec-api-key` where its inference API asks for it);
    `admin_headers`: sent besides them with the read of the BLS's config (`trtspec-admin-key` where Triton restricts
    its model-config API). Neither given: SpecClient's (the keys in the environment, or of a server this process
    started). `limits`: the front's (trtspec.openai_api.limits.Limits), resolved against the BLS's config on
    connect.

    `liveness`: what `/health/live` reads besides readiness (trtspec.openai_api.liveness; default: nothing, as for a
    front beside a Triton it did not start, which a restart of the front would not mend)."""

    def __init__(
        self,
        triton_url: str,
        *,
        model: str = BLS,
        served_model_name: str | None = None,
        tokenizer_dir: str | None = None,
        timeout: float = 600.0,
        triton_headers: dict[str, str] | None = None,
        admin_headers: dict[str, str] | None = None,
        limits: Limits | None = None,
        liveness: Liveness | None = None,
        spec_decode_metrics: str = "none",
        metrics_url: str | None = None,
    ):
        self.triton_url, self.model, self.timeout = triton_url, model, timeout
        if spec_decode_metrics not in SPEC_DECODE_METRICS_LEVELS:
            raise FrontError(
                f"per-request spec-decode metrics: {spec_decode_metrics!r} is not one of "
                f"{', '.join(SPEC_DECODE_METRICS_LEVELS)}"
            )
        self.spec_decode_metrics = spec_decode_metrics  # vLLM's per-request summary
        self.metrics_url = metrics_url  # Triton's metrics, which GET /metrics passes on
        self.liveness = liveness or Liveness(None)
        self._served, self._tokenizer_dir = served_model_name, tokenizer_dir
        given = triton_headers is not None or admin_headers is not None
        self._config_headers = (triton_headers or {}) | (admin_headers or {}) if given else None
        self._limits = limits or Limits()
        self.limits = self._limits.resolve()  # until connect reads the BLS's
        self.upstream = Upstream(triton_url, model, timeout, headers=triton_headers if given else None)
        self.tokenizer = None
        self.stopping = threading.Event()  # set when the front stops: streams in flight end at their next chunk

    def connect(self) -> Deployment:
        """Read the BLS's config from Triton and load its tokenizer; FrontError says what is missing."""
        with SpecClient(
            self.triton_url, protocol="http", model=self.model, timeout=10.0, headers=self._config_headers
        ) as client:
            try:
                config = client.model_config(self.model)
            except ClientError as exc:
                raise FrontError(
                    f"cannot read the config of '{self.model}' from Triton at {self.triton_url} (HTTP): "
                    f"{exc}. Start the deployment first (`trtspec serve --repo DIR`) or give Triton's "
                    "HTTP address (port 8000 by default, not gRPC's 8001) with --triton-url"
                ) from exc
        tokenizer_dir = self._tokenizer_dir or _parameter(config, "tokenizer_dir")
        if not tokenizer_dir:
            raise FrontError(
                f"'{self.model}' has no tokenizer_dir parameter; give the target's tokenizer with --tokenizer"
            )
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        except Exception as exc:  # transformers raises OSError, ValueError, ...
            raise FrontError(
                f"cannot load the tokenizer from {tokenizer_dir} ({exc}); when Triton runs on another "
                "machine, copy the target's tokenizer here and pass --tokenizer DIR"
            ) from exc
        self.tokenizer_dir = tokenizer_dir
        self.served_model = self._served or served_name_for(tokenizer_dir)
        # Prompts are counted as the BLS tokenizes them.
        self.add_special_tokens = (_parameter(config, "add_special_tokens") or "true").lower() in (
            "1",
            "true",
            "yes",
            "on",
        )
        # the engine models it calls: /health reports them too (a BLS whose target cannot serve serves nothing)
        self.engine_models = {
            "target": _parameter(config, "tensorrt_llm_model_name") or "tensorrt_llm",
            "draft": _parameter(config, "tensorrt_llm_draft_model_name"),
        }
        self.max_seq_len = _number(config, "max_seq_len")
        self.max_draft_len = _number(config, "max_draft_len") or 0
        admitted = [_number(config, key) for key in ("max_concurrent_requests", "max_queued_requests")]
        self.limits = self._limits.resolve(
            _number(config, "max_input_len"), sum(admitted) if None not in admitted else None
        )
        self.created = int(time.time())
        return self

    def response_metrics(self, completion: Completion) -> dict:
        """vLLM's `metrics.speculative_decoding` when asked for (trtspec.field_metrics), else nothing."""
        if self.spec_decode_metrics == "none":
            return {}
        summary = spec_decode_summary(
            completion.drafted_per_position, completion.accepted_per_position, self.max_draft_len
        )
        return {"metrics": {"speculative_decoding": summary}}

    async def health(self) -> dict[str, bool]:
        """Whether each model a request goes through is ready on Triton: the BLS, its target and its draft model
        (when it has one); every one False when Triton cannot be asked."""
        models = {"bls": self.model, **{role: name for role, name in self.engine_models.items() if name}}
        states = {role: await self.upstream.ready(name) for role, name in models.items()}
        self.liveness.seen(states["bls"] and states["target"])
        return states

    async def dead(self) -> str | None:
        """Why the deployment should be restarted (trtspec.openai_api.liveness), or None."""
        states = await self.health()
        down = [
            f"'{self.model if role == 'bls' else self.engine_models[role]}'" for role, ok in states.items() if not ok
        ]
        return await self.liveness.why_dead(self.model, self.engine_models["target"], down)

    # one request
    def prompt(self, req: Request) -> tuple[str, int]:
        """The text the BLS gets and its length in tokens, counted as the BLS counts it."""
        tok = self.tokenizer
        if req.kind == CHAT:
            if not getattr(tok, "chat_template", None):
                raise APIError(
                    400,
                    f"messages: the served model's tokenizer ({self.tokenizer_dir}) has no chat "
                    "template; use /v1/completions with a prompt, or add a chat_template to the "
                    "tokenizer",
                    param="messages",
                )
            from jinja2 import TemplateError

            try:
                text = tok.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)
            except (TemplateError, ValueError) as exc:  # the template's own checks (e.g. roles must alternate)
                raise APIError(400, f"messages: the chat template refused them: {exc}", param="messages") from exc
            # The BLS adds the tokenizer's special tokens itself: a template that writes the BOS would get two.
            bos = tok.bos_token
            if (
                self.add_special_tokens
                and bos
                and text.startswith(bos)
                and tok("", add_special_tokens=True)["input_ids"][:1] == [tok.bos_token_id]
            ):
                text = text[len(bos) :]
        else:
            text = req.prompt
        count = len(tok(text, add_special_tokens=self.add_special_tokens)["input_ids"])
        if req.max_tokens is None and self.max_seq_len:  # chat without a limit: whatever the context leaves
            req.max_tokens = max(self.max_seq_len - count, 1)
        return text, count

    def fields(self, req: Request, text: str) -> dict:
        """The BLS request for `req` with the prompt `text`. Perf metrics (the finish reason, the speculation
        figures) are asked for with the final response only: on every response they would cost each streamed token."""
        if req.max_tokens is None:
            raise APIError(
                400,
                f"{req.max_tokens_param}: is required by this deployment (its BLS has no max_seq_len parameter)",
                param=req.max_tokens_param,
            )
        return request_fields(
            text, max_tokens=req.max_tokens, stream=req.stream, final_perf_metrics_only=True, **req.generate_kwargs()
        )

    async def complete(self, req: Request, text: str) -> Completion:
        return await self.upstream.complete(self.fields(req, text))

    def stream(self, req: Request, text: str) -> AsyncIterator:
        """The BLS's responses to `req`: Chunks as they arrive, then the Completion."""
        return self.upstream.stream(self.fields(req, text))


# ---- the app -------------------------------------------------------------------------------------------------


def _error(exc: APIError) -> Response:
    # ASCII JSON: an error may quote what the client sent, whatever it holds
    return Response(json.dumps(exc.body()), exc.status, exc.headers, media_type="application/json")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def text_events(chunks: Chunks):
    """text -> the server-sent event of a text chunk, byte for byte `_sse(chunks.text(text))`: the event is rendered
    once around a placeholder, so a streamed chunk costs the encoding of its text and no more (framing alone)."""
    if chunks.req.logprobs:  # each chunk carries its own tokens' log probs: rendered whole
        return lambda text: _sse(chunks.text(text))
    mark = json.dumps("\x00")
    head, found, tail = _sse(chunks.text("\x00")).partition(mark)
    if not found or mark in tail:  # the placeholder is not the text alone (cannot happen with ids and names as made)
        return lambda text: _sse(chunks.text(text))
    return lambda text: head + json.dumps(text) + tail


def _read_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read().decode()


def create_app(deployment: Deployment, api_key: Key | None = None) -> Starlette:
    """The Starlette app; `deployment` must be connected (Deployment.connect). With `api_key`, every route but
    /health answers only to `Authorization: Bearer <key>`."""
    dep = deployment

    async def health(request: HTTPRequest):
        # ready: requests are served; degraded: served without the draft model (slower, while the BLS reloads it);
        # 503: the BLS or its target cannot serve (a load balancer should send requests elsewhere)
        states = await dep.health()
        down = [f"'{dep.model if role == 'bls' else dep.engine_models[role]}'" for role, ok in states.items() if not ok]
        if states["bls"] and states["target"]:
            body = {"status": "degraded" if down else "ready", "model": dep.served_model}
            if down:
                body["detail"] = f"the draft model {down[0]} is not ready: requests decode with the target alone"
            return JSONResponse(body)
        # the message names the models, not where Triton is: that address is internal
        return _error(APIError(503, f"{', '.join(down)} not ready on the inference server", code="unavailable"))

    async def live(request: HTTPRequest):
        # 503: restart me (Kubernetes' liveness probe); /health above is readiness: can requests be served now
        why = await dep.dead()
        if why is None:
            return JSONResponse({"status": "live", "model": dep.served_model})
        log.error("not live: %s", why)
        return _error(APIError(503, why, code="unavailable"))

    async def metrics(request: HTTPRequest):
        # the deployment's metrics beside its API, where tools look for them (AIPerf: the base URL + /metrics); HEAD
        # answered without a body (Triton 2.51's metrics port sends one with its 405, which breaks aiohttp's next
        # request on the connection, and AIPerf's check of the endpoint with it)
        if dep.metrics_url is None:
            raise APIError(
                404,
                "GET /metrics: this front was started without the deployment's metrics (serve "
                "them with `trtspec serve --openai-port`)",
                code="not_found",
            )
        try:
            text = await run_in_threadpool(_read_text, dep.metrics_url)
        except OSError:
            raise APIError(503, "the inference server's metrics cannot be read now", code="unavailable") from None
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def _model_card() -> dict:
        return {"id": dep.served_model, "object": "model", "created": dep.created, "owned_by": "trtspec"}

    async def models(request: HTTPRequest):
        return JSONResponse({"object": "list", "data": [_model_card()]})

    async def model(request: HTTPRequest):
        if request.path_params["model"] != dep.served_model:
            raise _unknown_model(request.path_params["model"])
        return JSONResponse(_model_card())

    def _unknown_model(name: str) -> APIError:
        return APIError(
            404,
            f"model: the model '{name}' does not exist; this server serves '{dep.served_model}' (GET /v1/models)",
            param="model",
            code="model_not_found",
        )

    async def generate(request: HTTPRequest, kind: str):
        raw = await read_body(request, dep.limits)
        try:  # bytes that are not UTF-8 become lone surrogates, which parse_request finds and names the field of
            body = json.loads(raw.decode("utf-8", "surrogateescape"))
        except ValueError as exc:
            raise APIError(400, f"body: not valid JSON ({exc}); send a JSON object", param="body") from None
        except RecursionError:
            raise APIError(400, "body: nested too deeply to parse; send a flat JSON object", param="body") from None
        req = parse_request(body, kind, dep.limits)
        if req.model != dep.served_model:
            raise _unknown_model(req.model)
        text, prompt_tokens = await run_in_threadpool(dep.prompt, req)
        if req.stream:
            return await _stream(req, text, prompt_tokens)
        try:
            completion = await dep.complete(req, text)
        except ClientError as exc:
            raise bls_error(exc, req) from exc
        stop = StopText(req.stop)
        out = stop.push(completion.text) + stop.flush()
        body = response(
            req, dep.served_model, out, finish_reason(completion, stop), prompt_tokens, completion, dep.tokenizer
        )
        return JSONResponse(body | dep.response_metrics(completion))

    async def _stream(req: Request, text: str, prompt_tokens: int):
        responses = dep.stream(req, text)
        # The first response decides the status: a request the BLS refuses gets a plain error response, not a stream.
        try:
            first = await anext(responses)
        except BaseException as exc:
            await responses.aclose()  # the client may have left before the first token: Triton's request goes too
            if isinstance(exc, ClientError):
                raise bls_error(exc, req) from exc
            raise
        chunks, stop = Chunks(req, dep.served_model, dep.tokenizer), StopText(req.stop)
        text_event = text_events(chunks)

        async def events():
            item = first
            try:
                if (start := chunks.start()) is not None:
                    yield _sse(start)
                while True:
                    if isinstance(item, Completion):
                        yield _sse(chunks.finish(stop.flush(), finish_reason(item, stop), item))
                        if req.include_usage:
                            yield _sse(chunks.usage(prompt_tokens, item) | dep.response_metrics(item))
                        break
                    chunks.add(item)  # its tokens' log probs, where asked for, go with the text sent next
                    if piece := stop.push(item.text):
                        yield text_event(piece)
                    if dep.stopping.is_set():
                        raise APIError(503, "the server is stopping; retry the request", code="unavailable")
                    item = await anext(responses)
                yield "data: [DONE]\n\n"
            except Exception as exc:  # mid-stream failure: OpenAI's clients raise on an event holding an error
                yield _sse((exc if isinstance(exc, APIError) else bls_error(exc, req)).body())
            finally:
                await responses.aclose()  # a client that left: the connection to Triton closes, cancelling the request

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    async def completions(request: HTTPRequest):
        return await generate(request, COMPLETION)

    async def chat_completions(request: HTTPRequest):
        return await generate(request, CHAT)

    async def api_error(request, exc: APIError):
        return _error(exc)

    async def http_error(request, exc: HTTPException):
        return _error(
            APIError(
                exc.status_code,
                f"{request.method} {request.url.path}: {exc.detail}; the API has "
                "GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health, GET /health/live, "
                "GET /metrics",
                code="not_found" if exc.status_code == 404 else None,
            )
        )

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/health/live", live, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await dep.upstream.start(dep.limits.connections)  # its connections belong to uvicorn's event loop
        try:
            yield
        finally:
            await dep.upstream.close()

    guards = [Middleware(AnswerFailures)]
    if api_key is not None:
        guards.insert(0, Middleware(RequireKey, key=api_key))  # outermost: before anything else is done
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=guards,
        exception_handlers={APIError: api_error, HTTPException: http_error},
    )


# ---- running it ----------------------------------------------------------------------------------------------


class Front:
    """The front on uvicorn in a background thread: beside tritonserver in `trtspec serve`, or in tests.

    Bound beyond loopback it needs `api_key` (FrontError otherwise); `host_option` names the option that chose
    `host`, for that error."""

    def __init__(
        self,
        deployment: Deployment,
        host: str = "127.0.0.1",
        port: int = 9000,
        log_level: str = "warning",
        *,
        api_key: Key | None = None,
        host_option: str = "--openai-host",
    ):
        import uvicorn

        check_exposure(host, api_key, host_option)
        self.deployment, self.host, self.port = deployment, host, port
        limits = deployment.limits
        config = uvicorn.Config(
            create_app(deployment, api_key),
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=5,
            http=http_protocol(limits),
            limit_concurrency=limits.connections,
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    @property
    def url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def start(self, timeout: float = 30.0) -> Front:
        check_port(self.host, self.port, "--openai-port")

        def run() -> None:
            try:
                self._server.run()
            except BaseException as exc:  # uvicorn exits (SystemExit) when it cannot bind
                self._failure = exc

        self._thread = threading.Thread(target=run, name="openai-front", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise FrontError(
                    f"the OpenAI front did not start on {self.host}:{self.port}"
                    + (f": {self._failure!r}" if self._failure else "")
                )
            time.sleep(0.02)
        return self

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        if self._thread is not None:
            self.deployment.stopping.set()  # streams end now; unary requests get the graceful-shutdown wait
            self._server.should_exit = True
            self._thread.join(timeout=15)
            self._thread = None

    def __enter__(self) -> Front:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def check_exposure(host: str, api_key: Key | None, option: str) -> None:
    """The front binds beyond loopback only with an API key: anyone who reaches it could generate otherwise."""
    if api_key is None and not is_loopback(host):
        raise FrontError(
            f"{option} {host or '(all interfaces)'} is not loopback: give the OpenAI front an API key "
            f"(--api-key-file FILE, or ${API_ENV}) that every request must send as `Authorization: Bearer <key>`, "
            "or bind it to 127.0.0.1"
        )


def check_port(host: str, port: int, option: str) -> None:
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise FrontError(
                f"port {port} on {host} is not free ({exc.strerror}); choose another with {option}"
            ) from None


def serve_front(
    triton_url: str, *, host: str, port: int, console, api_key: Key | None = None, **deployment_options
) -> int:
    """`trtspec openai`: the front alone, in the foreground, against a running deployment (Ctrl-C or SIGTERM stops
    it). `deployment_options`: Deployment's (triton_headers, admin_headers, limits, ...)."""
    import signal

    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _interrupt)
    front = None
    try:
        check_exposure(host, api_key, "--host")
        check_port(host, port, "--port")
        deployment = Deployment(triton_url, **deployment_options).connect()
        front = Front(deployment, host=host, port=port, api_key=api_key, host_option="--host").start()
        console.print(
            f"OpenAI API for '{front.deployment.served_model}' on {front.url}/v1 (Triton HTTP {triton_url});"
            " press Ctrl-C to stop",
            highlight=False,
        )
        while front.is_running():
            time.sleep(0.5)
        console.print("[red]the OpenAI front stopped unexpectedly[/red]")
        return 1
    except KeyboardInterrupt:
        console.print("stopping…")
        return 0
    finally:
        if front is not None:
            front.stop()
        signal.signal(signal.SIGTERM, previous)


def run_with_triton(
    server,
    console,
    start_timeout: float | None,
    *,
    port: int,
    host: str = "127.0.0.1",
    api_key: Key | None = None,
    after_start=None,
    **deployment_options,
) -> int:
    """`trtspec serve --openai-port`: tritonserver, then the front beside it on its own `host` (Triton may stay on
    loopback while the front, with its `api_key`, is the public surface); Ctrl-C or SIGTERM stops the front first
    (no request reaches a stopping Triton), then Triton. Returns an exit code; a start that fails raises
    (ServerError, FrontError) for the CLI to print. `deployment_options`: Deployment's."""
    import signal

    from rich.markup import escape

    from trtspec.server import start_timeout_for

    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _interrupt)
    front = None
    try:
        if port in (server.http_port, server.grpc_port, server.metrics_port):
            raise FrontError(f"--openai-port {port} is one of Triton's ports; choose another (e.g. 9000)")
        check_exposure(host, api_key, "--openai-host")  # before the (long) model loading, not after
        check_port(host, port, "--openai-port")
        timeout = start_timeout_for(server.repo) if start_timeout is None else start_timeout
        with console.status(f"starting tritonserver (waiting up to {timeout:.0f} s for its models)…"):
            server.start(timeout)
        if after_start is not None:  # the calibration, before the front takes a request
            after_start()
        # the front restarts nothing by itself: under `serve`, /health/live tells the pod's supervisor when to
        liveness = Liveness(server.metrics_url, unready_grace=timeout)
        deployment = Deployment(
            server.http_url, liveness=liveness, metrics_url=server.metrics_url, **deployment_options
        ).connect()
        front = Front(deployment, host=host, port=port, api_key=api_key).start()
        console.print(f"[green]Triton is ready[/green] (pid {server.pid})")
        for label, value in (
            ("HTTP", server.http_base_url),
            ("gRPC", server.grpc_url),
            ("metrics", server.metrics_url),
            ("OpenAI", f"{front.url}/v1  (model '{front.deployment.served_model}')"),
            ("log", server.log_path),
            ("admin key", server.admin_key.source),
        ):
            console.print(f"  {label:<8} {escape(str(value))}", highlight=False)
        console.print("Press Ctrl-C to stop.")
        while server.is_running() and front.is_running():
            time.sleep(0.5)
        what = "tritonserver" if not server.is_running() else "the OpenAI front"
        console.print(f"[red]{what} stopped unexpectedly.[/red] Triton log: {escape(str(server.log_path))}")
        return 1
    except KeyboardInterrupt:
        console.print("stopping…")
        return 0
    finally:
        if front is not None:
            front.stop()
        server.stop()
        signal.signal(signal.SIGTERM, previous)
