"""OpenAI's request shapes, checked without a server: what the front accepts and what it refuses (naming the field
and the fix), as a `Request` for the BLS. Its limits are in `limits`, its errors in `errors`, the response shapes in
`responses`."""

from __future__ import annotations

from dataclasses import dataclass, field

from trtspec.interfaces import SPECULATION_METHODS
from trtspec.openai_api.errors import APIError, bad
from trtspec.openai_api.limits import DEFAULT_LIMITS, Limits

COMPLETION, CHAT = "text_completion", "chat.completion"
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


# Accepted: they change nothing in the generated text (`store` false keeps a request out of `serve --capture`).
HARMLESS = {
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "parallel_tool_calls",
}
# OpenAI fields this front cannot honour: refused unless they hold their neutral value (so clients that send
# the defaults explicitly still work). field -> (is the value neutral?, the fix).
_UNSUPPORTED = {
    "top_logprobs": (
        lambda v: v == 0 and not isinstance(v, bool),
        "send 0 or leave it out: this server returns the chosen token's log probability (logprobs: true), not the "
        "likeliest alternatives",
    ),
    "echo": (lambda v: v is False, "leave it out: the prompt is not echoed; prepend it yourself"),
    "best_of": (lambda v: v == 1 and not isinstance(v, bool), "leave it out or send 1"),
    "suffix": (lambda v: v == "", "leave it out: insertion is not supported"),
    "logit_bias": (lambda v: v == {}, "leave it out: logit biases are not supported"),
    "tools": (lambda v: v == [], "leave it out: tool calls are not supported"),
    "tool_choice": (lambda v: v == "none", "leave it out: tool calls are not supported"),
    "functions": (lambda v: v == [], "leave it out: function calls are not supported"),
    "function_call": (lambda v: v == "none", "leave it out: function calls are not supported"),
    "response_format": (
        lambda v: v == {"type": "text"},
        'leave it out or send {"type": "text"}: structured output is not supported',
    ),
    "modalities": (lambda v: v == ["text"], 'leave it out or send ["text"]'),
    "audio": (lambda v: False, "leave it out: audio is not supported"),
}
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    # what vLLM, SGLang and trtllm-serve accept beyond OpenAI's fields, and benchmark clients (AIPerf,
    # guidellm) send for fixed output lengths
    "ignore_eos",
    "min_tokens",
    # trtspec's additions, sent with the openai package's extra_body
    "num_draft_tokens",
    "speculation",
    "adaptive_draft_length",
    "stream_interval",  # tokens per streamed message, as vLLM's and SGLang's --stream-interval
    # OpenAI's Predicted Outputs: a draft source (trtspec.orchestrator.drafters.prediction)
    "prediction",
    "presence_penalty",
    "frequency_penalty",
}
_FIELDS = {
    COMPLETION: _COMMON | {"prompt", "echo", "best_of", "suffix", "logprobs", "logit_bias"},
    CHAT: _COMMON
    | {"messages", "max_completion_tokens", "logprobs"}
    | (set(_UNSUPPORTED) - {"echo", "best_of", "suffix"}),
}


def check_text(body) -> None:
    """Refuse a body holding a string that is not Unicode text: a lone surrogate (JSON allows "\\ud800") or, decoded
    with surrogateescape, bytes that are not UTF-8. The tokenizer would fail on it; the error names the field."""
    todo: list[tuple[str | None, object]] = [(None, body)]
    while todo:  # iterative: a body may nest as deep as JSON's parser allows
        path, value = todo.pop()
        if isinstance(value, str):
            _utf8(value, path or "body")
        elif isinstance(value, dict):
            items = []
            for key, item in value.items():
                name = f"{path}.{_printable(key)}" if path else _printable(key)
                _utf8(key, name)
                items.append((name, item))
            todo.extend(reversed(items))
        elif isinstance(value, list):
            todo.extend(reversed([(f"{path or 'body'}[{i}]", item) for i, item in enumerate(value)]))


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _utf8(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad(
            param,
            f"character {exc.start} is a lone surrogate (U+{ord(text[exc.start]):04X}) or a byte that is not "
            "UTF-8; send UTF-8 text (a surrogate escape must come in a high-low pair)",
        ) from None


# prompt_ignore_length that skips the whole prompt, whatever its length (the BLS clamps it to the prompt's)
WHOLE_PROMPT = 2**31 - 1


@dataclass
class Request:
    """A checked OpenAI request: what the BLS is asked for (None: the BLS's or the front's default)."""

    kind: str
    model: str
    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the field the client named it with, for errors
    store: bool | None = None  # false: never captured by `trtspec serve --capture` (the BLS's `store`)
    temperature: float = 1.0  # OpenAI's default: sampling; send 0 for greedy
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False  # generate max_tokens: the end token is an ordinary token
    min_tokens: int | None = None  # no end token before this many tokens (the engine's min_tokens)
    num_draft_tokens: int | None = None
    speculation: str | None = None
    adaptive_draft_length: bool | None = None
    stream_interval: int | None = None
    prediction: str | None = None  # the predicted output's text ("" : an empty prediction, which drafts nothing)
    logprobs: bool = False  # each token's log probability (chat: logprobs true; completions: logprobs 0)
    presence_penalty: float | None = None  # OpenAI's: counting the answer's tokens alone, not the prompt's
    frequency_penalty: float | None = None

    @property
    def prompt_param(self) -> str:
        """The field that carries the prompt, for errors."""
        return "prompt" if self.kind == COMPLETION else "messages"

    def generate_kwargs(self) -> dict:
        """SpecClient.generate's keywords (besides the prompt and max_tokens)."""
        temperature, top_p = self.temperature, self.top_p
        if top_p == 0.0:  # a nucleus of no mass is the likeliest token alone
            temperature, top_p = 0.0, None
        if temperature > 0 and top_p is None:
            top_p = 1.0  # OpenAI's default; the BLS, as TensorRT-LLM, reads top_k 0 with top_p 0 as greedy
        return {
            "temperature": temperature,
            "store": self.store,
            "top_p": top_p if temperature > 0 else None,
            "seed": self.seed,
            "stop_words": self.stop or None,
            "end_id": -1 if self.ignore_eos else None,
            "min_tokens": self.min_tokens,
            "num_draft_tokens": self.num_draft_tokens,
            "speculation": self.speculation,
            "adaptive_draft_length": self.adaptive_draft_length,
            "stream_interval": self.stream_interval,
            "prediction": self.prediction,
            "return_log_probs": self.logprobs or None,
            "presence_penalty": self.presence_penalty or None,
            "frequency_penalty": self.frequency_penalty or None,
            # the BLS skips this many of the prompt's tokens, at most all of them: the answer's alone count
            "prompt_ignore_length": WHOLE_PROMPT if self.presence_penalty or self.frequency_penalty else None,
        }


# ---- checking a request ---------------------------------------------------------------------------------------


def _int(body: dict, name: str, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(name, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise bad(name, f"must be an integer >= {minimum}, got {value}")
    return value


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise bad(name, f"must be a number between {low:g} and {high:g}, got {value!r}")
    if not low <= value <= high:
        raise bad(name, f"must be between {low:g} and {high:g}, got {value}")
    return float(value)


def _bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad(name, f"must be true or false, got {value!r}")
    return value


def _stop(value, limits: Limits) -> list[str]:
    if value is None:
        return []
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
        raise bad("stop", f"must be a non-empty string or a list of them, got {_short(value)}")
    if len(words) > limits.stop_strings:
        raise bad("stop", f"holds {len(words)} strings; this server accepts at most {limits.stop_strings}")
    for i, word in enumerate(words):
        if len(word) > limits.stop_chars:
            raise bad(
                "stop",
                f"stop[{i}] has {len(word)} characters; this server accepts at most {limits.stop_chars} a string",
            )
    return list(dict.fromkeys(words))


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."  # an error never echoes a whole body back


def _prompt(value, limits: Limits) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if not isinstance(value, str):
        raise bad(
            "prompt",
            "must be a string (or a list of one string); token-id prompts and batches of prompts "
            "are not supported: send one text per request",
        )
    if not value:
        raise bad("prompt", "must not be empty")
    if len(value) > limits.prompt_chars:
        raise bad("prompt", f"has {len(value)} characters; {_prompt_limit(limits)}")
    return value


def _prompt_limit(limits: Limits) -> str:
    return (
        f"this deployment accepts at most {limits.prompt_chars} ({limits.chars_per_token} a token of its "
        "max_input_len); shorten it"
    )


def _messages(value, limits: Limits) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad("messages", 'must be a non-empty list of {"role": ..., "content": ...} objects')
    if len(value) > limits.messages:
        raise bad(
            "messages",
            f"holds {len(value)} messages; this deployment accepts at most {limits.messages} (its max_input_len: "
            "every message costs a token at least)",
        )
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, f"must be an object with role and content, got {message!r}")
        role, content = message.get("role"), message.get("content")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise bad(
                f"{where}.role",
                f"must be system, developer, user or assistant, got {role!r} (tool messages are not supported)",
            )
        if message.get("tool_calls") or message.get("function_call"):
            raise bad(where, "tool and function calls are not supported; send plain text messages")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(
                        f"{where}.content",
                        f'only text parts ({{"type": "text", "text": ...}}) are supported, got {part!r}',
                    )
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(f"{where}.content", f"must be a string or a list of text parts, got {content!r}")
        out.append({"role": role, "content": content})
    if (chars := sum(len(m["content"]) for m in out)) > limits.prompt_chars:
        raise bad("messages", f"their contents have {chars} characters; {_prompt_limit(limits)}")
    return out


def parse_request(body, kind: str, limits: Limits = DEFAULT_LIMITS) -> Request:
    """Check an OpenAI request body (`kind`: COMPLETION or CHAT) against `limits` (resolved); APIError names the
    first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_text(body)
    body = {k: v for k, v in body.items() if v is not None}  # null is OpenAI's "not given"
    known = _FIELDS[kind] | HARMLESS
    for name in body:
        if name not in known:
            other = "/v1/chat/completions" if kind == COMPLETION else "/v1/completions"
            hint = (
                f"it belongs to {other}"
                if name in _FIELDS[CHAT if kind == COMPLETION else COMPLETION]
                else "this server does not know it"
            )
            raise bad(name, f"is not supported here ({hint}); leave it out")
    for name, (neutral, fix) in _UNSUPPORTED.items():
        if name in body and name in _FIELDS[kind] and not neutral(body[name]):
            raise bad(name, f"{body[name]!r} is not supported; {fix}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "is required: the id of the served model (GET /v1/models lists it)")
    req = Request(kind=kind, model=model)
    if kind == COMPLETION:
        if "prompt" not in body:
            raise bad("prompt", "is required")
        req.prompt = _prompt(body["prompt"], limits)
    else:
        if "messages" not in body:
            raise bad("messages", "is required")
        req.messages = _messages(body["messages"], limits)
    lengths = [("max_tokens", _int(body, "max_tokens", 1))]
    if kind == CHAT:
        lengths.insert(0, ("max_completion_tokens", _int(body, "max_completion_tokens", 1)))
    for name, value in lengths:
        if value is not None:
            req.max_tokens, req.max_tokens_param = value, name
            break
    if kind == COMPLETION and req.max_tokens is None:
        req.max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    temperature = _number(body, "temperature", 0.0, 2.0)
    req.temperature = 1.0 if temperature is None else temperature
    req.top_p = _number(body, "top_p", 0.0, 1.0)
    req.seed = _int(body, "seed", 0)
    req.stop = _stop(body.get("stop"), limits)
    n = _int(body, "n", 1)
    if n not in (None, 1):
        raise bad(
            "n",
            f"only 1 choice per request is supported, got {n}; send n separate requests (with different seeds) instead",
        )
    req.stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None:
        if not req.stream:
            raise bad("stream_options", "is only allowed with stream: true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad("stream_options", f'must be {{"include_usage": true|false}}, got {options!r}')
        req.include_usage = bool(_bool(options, "include_usage"))
    req.ignore_eos = bool(_bool(body, "ignore_eos"))
    req.store = _bool(body, "store")  # false: the client asks that nothing of it be kept
    req.min_tokens = _int(body, "min_tokens", 0)
    if req.min_tokens is not None and req.max_tokens is not None and req.min_tokens > req.max_tokens:
        raise bad("min_tokens", f"{req.min_tokens} exceeds {req.max_tokens_param} {req.max_tokens}; lower it")
    req.num_draft_tokens = _int(body, "num_draft_tokens", 0)
    speculation = body.get("speculation")
    if speculation is not None and speculation not in SPECULATION_METHODS:
        raise bad("speculation", f"must be one of {', '.join(SPECULATION_METHODS)}, got {speculation!r}")
    req.speculation = speculation
    req.adaptive_draft_length = _bool(body, "adaptive_draft_length")
    req.stream_interval = _int(body, "stream_interval", 0)
    req.logprobs = _logprobs(body, kind)
    req.presence_penalty = _number(body, "presence_penalty", -2.0, 2.0)
    req.frequency_penalty = _number(body, "frequency_penalty", -2.0, 2.0)
    if "prediction" in body:
        req.prediction = _prediction(body["prediction"], limits)
    return req


def _logprobs(body: dict, kind: str) -> bool:
    """Chat's `logprobs` (true or false); the completions' (how many likeliest tokens besides the chosen one: 0
    alone is served, the chosen token's log probability)."""
    if kind == CHAT:
        return bool(_bool(body, "logprobs"))
    if body.get("logprobs") is False:  # not OpenAI's type, but clients send it for "none"
        return False
    count = _int(body, "logprobs", 0)
    if count is not None and count > 0:
        raise bad(
            "logprobs",
            f"{count} is not supported; send 0 for the chosen token's log probability alone: this server does not "
            "return the likeliest alternatives",
        )
    return count is not None


def _prediction(value, limits: Limits) -> str:
    """OpenAI's `prediction`: {"type": "content", "content": text or a list of text parts} -> the text."""
    if not isinstance(value, dict) or value.get("type") != "content" or set(value) - {"type", "content"}:
        raise bad("prediction", f'must be {{"type": "content", "content": ...}}, got {_short(value)}')
    content = value.get("content")
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(
                    f"prediction.content[{i}]",
                    f'only text parts ({{"type": "text", "text": ...}}) are supported, got {_short(part)}',
                )
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad("prediction.content", f"must be a string or a list of text parts, got {_short(content)}")
    if len(content) > limits.prompt_chars:
        raise bad("prediction.content", f"has {len(content)} characters; {_prompt_limit(limits)}")
    return content
