"""The `tensorrt_llm_bls` model's parameters: one field each, its default, and how the BLS reads them.

Triton hands a Python model its config.pbtxt `parameters` as strings. A parameter that is empty or still a template
field (`${...}`) counts as unset and takes the field's default here, as in NVIDIA's models. `trtspec deploy`
(trtspec.deploy.writer) writes the fields marked per build from the build config, the engines and its options, and
every other field at its default, so a repository and a BLS without the parameter behave alike.

Pure Python: the repository imports it outside Triton, and the Triton models read their parameters with it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass

from trtspec.errors import TrtspecError
from trtspec.orchestrator.adaptive import CostModel

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
_COSTS = CostModel()  # the adaptive draft length's cost prior, in one target step's units
PER_BUILD = "per_build"  # field metadata: deploy writes it from the build, not at its default
REQUIRED = "required"  # field metadata: a BLS without it fails to load
BUILD_LABELS = ("target", "draft", "quantization", "max_draft_len", "trtspec_version")
# a prompt's characters per token of max_input_len before it is refused untokenized: about four times an English
# token's length, so only text of unusually long tokens (runs of spaces, say) meets it before max_input_len does
INPUT_CHARS_PER_TOKEN = 16
# requests the BLS serves at once per batch slot of the target engine: each alternates between a draft call and a
# verification, so twice the batch keeps the target's batch full while the other half drafts, and no more sequences
# are in flight than the KV cache keeps between their calls (each re-sends its sequence and reuses its blocks)
CONCURRENT_REQUESTS_PER_BATCH_SLOT = 2


def parameter(params: Mapping[str, str], key: str, default: str | None = None) -> str:
    value = params.get(key, "")
    if value == "" or value.startswith("${"):  # an unfilled template field counts as unset, as in the stock models
        if default is None:
            raise TrtspecError(f"model parameter '{key}' is not set; regenerate the repository with `trtspec deploy`")
        return default
    return value


def bool_parameter(params: Mapping[str, str], key: str, default: bool) -> bool:
    value = parameter(params, key, "true" if default else "false").strip().lower()
    if value not in _TRUE | _FALSE:
        raise TrtspecError(f"model parameter '{key}' = {value!r} is not a boolean (true or false)")
    return value in _TRUE


def _per_build(default: object):
    """A field deploy writes from the build; `default` is what the BLS assumes where a repository leaves it unset."""
    return dataclasses.field(default=default, metadata={PER_BUILD: True})


def _required():
    """A field deploy writes from the build and the BLS cannot do without."""
    return dataclasses.field(default=None, metadata={PER_BUILD: True, REQUIRED: True})


@dataclass(frozen=True)
class ServingSettings:
    """The BLS's deployment settings, in the order of its config.pbtxt template."""

    # the target engine model the BLS calls (the stock name, which deploy writes)
    tensorrt_llm_model_name: str = _per_build("tensorrt_llm")
    # the draft engine model ("": none, so requests draft by prompt lookup or not at all)
    tensorrt_llm_draft_model_name: str = _per_build("")
    # the target's tokenizer (its engine dir), for prompts, stop and bad words, and the output text
    tokenizer_dir: str | None = _required()
    # prompts are tokenized with the tokenizer's special tokens (BOS), as NVIDIA's preprocessing does
    add_special_tokens: bool = True
    # the output text leaves special tokens out, as NVIDIA's postprocessing does
    skip_special_tokens: bool = True
    # K of a request that names neither num_draft_tokens nor speculation (0: plain decoding, as NVIDIA's BLS)
    default_num_draft_tokens: int = _per_build(0)
    # K of a request that names only `speculation` (None: default_num_draft_tokens, or 4 where that is 0)
    speculation_num_draft_tokens: int | None = _per_build(None)
    # the draft source of a request that names none (None: draft_model with a draft model, else none)
    default_speculation: str | None = _per_build(None)
    # the draft length follows each request's measured acceptance (a request's adaptive_draft_length overrides it)
    adaptive_draft_length: bool = _per_build(True)
    # prompt lookup's longest n-gram to match against the text so far
    max_matching_ngram_size: int = _per_build(3)
    # above this many requests in flight new requests decode plainly (0: no limit; `bench --apply` measures it)
    max_speculative_concurrency: int = 0
    # requests served at once, each on its own thread; deploy writes CONCURRENT_REQUESTS_PER_BATCH_SLOT x the target
    # engine's max_batch_size (trtspec.deploy.writer), so the requests admitted keep their sequences in the KV cache
    max_concurrent_requests: int = _per_build(64)
    # requests allowed to wait beyond those served; more are refused at once with an error
    max_queued_requests: int = 256
    # the longest a request may take from its arrival; a request's timeout_ms may shorten it, never lift it (0: no
    # limit). 10 minutes: a production pair's whole 8192-token max_seq_len at 14 tokens/s, and the OpenAI front's own
    # --timeout default, so both give up together
    request_timeout_ms: int = 600000
    # tokens per streamed response of a request that names no stream_interval: 0 (or 1) sends each token as it comes,
    # gathering only those a client behind has not taken yet; n sends n at a time, the first token and the final
    # response at once (vLLM's and SGLang's --stream-interval)
    stream_interval: int = 0
    # stop words and bad words a request may name: 4x the OpenAI front's 16 stop strings (which it sends as stop
    # words), room for a stock client's variants of each word; each is tokenized, and bad words cost each step
    max_stop_words: int = 64
    max_bad_words: int = 64
    # the longest stop or bad word, in characters, checked before tokenizing it: a phrase, not a document
    max_word_chars: int = 256
    # a draft call unanswered this long is a draft failure and the request goes on with the target alone (0: no
    # limit); above the ~1 s in which Triton reports a dead Python model, so a dead draft counts as dead, not slow
    draft_timeout_ms: int = 5000
    # how long a request whose target process died waits for the BLS to load it again, then goes on from its tokens
    # (past it, or past its own timeout_ms, it ends UNAVAILABLE, worth a retry)
    target_recovery_timeout_ms: int = 120000
    # trtspec_build_info's labels: what is deployed, by name (docs/metrics.md)
    build_target: str = _per_build("")
    build_draft: str = _per_build("")
    build_quantization: str = _per_build("")
    build_max_draft_len: str = _per_build("")
    build_trtspec_version: str = _per_build("")
    # c: one draft step over one target step, until `bench --apply` measures it (CostModel's prior)
    draft_cost_ratio: float = _COSTS.draft_cost_ratio
    # b: the verification cost of each draft token beyond a plain step (CostModel's prior)
    verify_cost_per_token: float = _COSTS.verify_cost_per_token
    # v0: what a verifying pass costs beyond a plain step whatever K is (CostModel's prior)
    verify_cost_fixed: float = _COSTS.verify_cost_fixed
    # the target engine's max_draft_len: the longest draft a request may ask for
    max_draft_len: int = _per_build(0)
    # after each change of the speculation governor's level, how long it waits before judging again
    governor_hold_seconds: float = 30.0
    # the fullest GPU's planned steady memory use, where the GPU-memory alerts fire above (0: no GPU plan)
    gpu_memory_planned_fraction: float = _per_build(0.0)
    # the longest prompt, in tokens
    max_input_len: int | None = _required()
    # the longest prompt plus output, in tokens
    max_seq_len: int | None = _required()
    # the longest prompt in characters, refused before it is tokenized (None: INPUT_CHARS_PER_TOKEN x max_input_len)
    max_input_chars: int | None = _per_build(None)
    # what the target engine was built to return: a request for logits it cannot return is refused
    gather_context_logits: bool = _per_build(False)
    gather_generation_logits: bool = _per_build(False)
    # the most logits one request may have returned (tokens x vocabulary, context and generation together; 0: none):
    # 2^24 floats, 64 MiB, e.g. 128 tokens of Llama 3's 128k vocabulary (a whole Llama 3 answer's are ~1 GB)
    max_returned_logits: int = 1 << 24
    # a request that does not say drafts with the draft model's logits (rejection sampling) or token matching
    use_draft_logits_default: bool = _per_build(False)
    # whether the target engine model takes promptIgnoreLength (contract.takes_prompt_ignore): a request's
    # prompt_ignore_length is refused where it would change its penalties and the engine cannot honour it
    engine_prompt_ignore_length: bool = _per_build(False)
    # whether the engine models are decoupled: the BLS then reads their response streams (template field
    # ${decoupled_mode}, which the engine models share)
    engine_decoupled_mode: bool = _per_build(False)

    def __post_init__(self):
        for name in ("draft_timeout_ms", "request_timeout_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"the parameter {name} must be >= 0 (0: no limit), got {getattr(self, name)}")
        for name in ("max_stop_words", "max_bad_words", "max_returned_logits"):
            if getattr(self, name) < 0:
                raise ValueError(f"the parameter {name} must be >= 0 (0: none allowed), got {getattr(self, name)}")
        for name in ("max_word_chars", "max_input_chars"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"the parameter {name} must be >= 1, got {value}")
        if self.governor_hold_seconds < 0:
            raise ValueError(f"the parameter governor_hold_seconds must be >= 0, got {self.governor_hold_seconds:g}")

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> ServingSettings:
        """The settings a BLS's `parameters` (strings, as Triton hands them over) set, the defaults elsewhere.
        A required one unset, or a value that does not read as its field's type, raises."""
        hints = typing.get_type_hints(cls)
        values = {}
        for field in dataclasses.fields(cls):
            kind = _kind(hints[field.name])
            if kind is bool:
                values[field.name] = bool_parameter(params, field.name, field.default)
                continue
            text = parameter(params, field.name, None if field.metadata.get(REQUIRED) else "")
            values[field.name] = kind(text) if text else field.default
        # the two defaults that follow from other settings
        if values["speculation_num_draft_tokens"] is None:
            values["speculation_num_draft_tokens"] = values["default_num_draft_tokens"] or 4
        if values["default_speculation"] is None:
            values["default_speculation"] = "draft_model" if values["tensorrt_llm_draft_model_name"] else "none"
        if values["max_input_chars"] is None:
            values["max_input_chars"] = INPUT_CHARS_PER_TOKEN * values["max_input_len"]
        return cls(**values)

    @classmethod
    def written_defaults(cls) -> dict[str, object]:
        """The template values deploy writes alike for every build: each field not per build, at its default."""
        return {
            field.name: _template_value(field.default)
            for field in dataclasses.fields(cls)
            if not field.metadata.get(PER_BUILD)
        }

    def build_info(self) -> dict[str, str]:
        """trtspec_build_info's labels by label name (build_target: target, ...)."""
        return {key: getattr(self, f"build_{key}") for key in BUILD_LABELS}


def _kind(hint) -> type:
    """The type a field's text is read as: `int | None` reads as int."""
    return next((arg for arg in typing.get_args(hint) if arg is not type(None)), hint)


def _template_value(value: object) -> object:
    """A default as a template value: numbers without a needless fraction ("0", "30", "0.3")."""
    return f"{value:g}" if isinstance(value, float) else value
