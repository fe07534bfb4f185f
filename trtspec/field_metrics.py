"""The field's metric schema, beside trtspec's own (docs/metrics.md maps every name): vLLM's names, which AIPerf,
NVIDIA Dynamo's planner and the Gateway API Inference Extension's endpoint picker read, and vLLM's per-request
speculative-decoding summary.

Counters (vllm-project/vllm, vllm/v1/spec_decode/metrics.py, SpecDecodingProm; labels `model_name` and `engine`
as vllm/v1/metrics/loggers.py gives every vLLM metric):

  num_drafts            verification steps that carried a draft (a plain decoding step is none)
  num_draft_tokens      draft tokens proposed
  num_accepted_tokens   of those, accepted
  accepted_per_pos{position=i}  steps whose draft position i was accepted (a draft is accepted as a prefix)

  acceptance rate        = num_accepted_tokens / num_draft_tokens
  mean acceptance length = 1 + num_accepted_tokens / num_drafts   (the bonus token included)

Gauges the endpoint picker reads (gateway-api-inference-extension v1.5.0, pkg/epp/server/options.go defaults and
the core-metrics-extractor's built-in `vllm` engine; docs/proposals/003-model-server-protocol): requests waiting,
requests running, and the KV cache's used fraction (0..1, despite "perc").
"""

from __future__ import annotations

# ---- Prometheus names (Triton's custom-metrics API takes ':' in a name: measured on tritonserver 2.51) ---------
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
REQUESTS_WAITING = "vllm:num_requests_waiting"
REQUESTS_RUNNING = "vllm:num_requests_running"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
ENGINE = "0"  # vLLM's `engine` label: the data-parallel engine's index; a trtspec deployment is one engine

# ---- the endpoint picker (GAIE's EPP) ------------------------------------------------------------------------
# Its legacy flags (v1.5.0 pkg/epp/server/options.go; deprecated there for the EndpointPickerConfig's
# engineConfigs, still read): the defaults are the vLLM names above, so a picker reads trtspec's with no flag, and
# these name them explicitly. LoRA and cache-info metrics trtspec does not export: "" stops the picker asking.
PICKER_METRIC_FLAGS = {
    "total-queued-requests-metric": REQUESTS_WAITING,
    "total-running-requests-metric": REQUESTS_RUNNING,
    "kv-cache-usage-percentage-metric": KV_CACHE_USAGE,
    "lora-info-metric": "",
    "cache-info-metric": "",
}
# The picker scrapes the pool's target port unless told another: trtspec's metrics are on Triton's metrics port,
# not the front's (datastore.go: MetricsHost is the target port when --model-server-metrics-port is 0).
PICKER_METRICS_PORT_FLAG = "model-server-metrics-port"
PICKER_ENGINE = "trtspec"  # the core-metrics-extractor's engine entry naming the same metrics

# ---- per-request summary (vLLM --per-request-spec-decode-metrics) -------------------------------------------
SPEC_DECODE_METRICS_LEVELS = ("none", "summary")  # vLLM's `detailed` needs per-step records the BLS does not keep


def spec_decode_summary(
    drafted_per_position: list[int], accepted_per_position: list[int], num_spec_tokens: int
) -> dict:
    """vLLM's `metrics.speculative_decoding` summary for one request, from the BLS's per-position counts
    (docs/features/speculative_decoding/acceptance_metrics.md in vllm-project/vllm gives the shape).

    drafted_per_position[i]: steps that drafted more than i tokens, so [0] is the steps that drafted at all;
    accepted_per_position[i]: steps that accepted more than i (drafts are accepted as a prefix). The steps that
    accepted exactly j are therefore accepted[j-1] - accepted[j] (with accepted[-1] = the steps). The histogram by
    draft length is given when every step drafted the same length; per-position counts cannot split steps of
    several lengths by their acceptance, and it is then left out."""
    drafted, accepted = list(drafted_per_position), list(accepted_per_position)
    k = max(num_spec_tokens, len(drafted))
    steps = drafted[0] if drafted else 0
    at_least = [steps] + accepted + [0] * (k + 1 - len(accepted))  # at_least[j]: steps that accepted j or more
    histogram = [at_least[j] - at_least[j + 1] for j in range(k + 1)]
    num_accepted, num_drafted = sum(accepted), sum(drafted)
    out = {
        "mean_acceptance_length": 1 + num_accepted / steps if steps else 1.0,
        "draft_acceptance_rate": num_accepted / num_drafted if num_drafted else 0.0,
        "acceptance_histogram": histogram,
    }
    lengths = [n for n in range(1, len(drafted) + 1) if drafted[n - 1] - (drafted[n] if n < len(drafted) else 0)]
    if len(lengths) == 1:
        out["acceptance_histogram_by_draft_length"] = {str(lengths[0]): histogram[: lengths[0] + 1]}
    elif not lengths:
        out["acceptance_histogram_by_draft_length"] = {}
    return out | {
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": num_accepted,
        "num_draft_tokens": num_drafted,
        "num_spec_tokens": k,
    }
