"""An OpenAI-compatible HTTP API (`/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/health`) in front of a
deployment's speculative `tensorrt_llm_bls`, over Triton's HTTP generate endpoints. `protocol` checks requests
(against `limits.Limits`), `responses` shapes the answers and `errors` the refusals; `guard` checks the API key and
bounds bodies and stalled connections; `app` is the Starlette app and the runners (`trtspec serve --openai-port`,
`trtspec openai`)."""

from trtspec.openai_api.app import Deployment, Front, FrontError, create_app, run_with_triton, serve_front
from trtspec.openai_api.errors import APIError
from trtspec.openai_api.limits import Limits
from trtspec.openai_api.protocol import parse_request

__all__ = [
    "APIError",
    "Deployment",
    "Front",
    "FrontError",
    "Limits",
    "create_app",
    "parse_request",
    "run_with_triton",
    "serve_front",
]
