"""A hop's streamed messages and tokens as Prometheus counters (trtspec.stream_sender names them): messages / tokens
is the hop's messages per token, 1 where every reader keeps up, less where messages gathered tokens."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from trtspec.stream_sender import MESSAGES_HELP, MESSAGES_METRIC, TOKENS_HELP, TOKENS_METRIC
from trtspec.triton.common import METRIC_CALLS


class StreamCounters:
    """`trtspec_stream_messages_total` and `trtspec_stream_tokens_total` with labels model and hop. `add` is two
    messages to the server process: call it once per stream, at its end."""

    def __init__(self, model: str, hop: str):
        labels = {"model": model, "hop": hop}
        with METRIC_CALLS:
            self._families = [  # a family must outlive its metrics
                pb_utils.MetricFamily(name=name, kind=pb_utils.MetricFamily.COUNTER, description=description)
                for name, description in ((MESSAGES_METRIC, MESSAGES_HELP), (TOKENS_METRIC, TOKENS_HELP))
            ]
            self._messages, self._tokens = (f.Metric(labels=labels) for f in self._families)

    def add(self, messages: int, tokens: int) -> None:
        """Called by every stream's thread at its end: the counters are shared, so under METRIC_CALLS."""
        with METRIC_CALLS:
            if messages:
                self._messages.increment(messages)
            if tokens:
                self._tokens.increment(tokens)
