"""An OpenAI-compatible HTTP API (`/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/health`) in front of a
deployment's speculative `tensorrt_llm_bls`, over gRPC. `protocol` checks requests and shapes responses;
`app` is the Starlette app, the client pool and the runners (`trtspec serve --openai-port`, `trtspec openai`)."""

from trtspec.openai_api.app import Deployment, Front, FrontError, create_app, run_with_triton, serve_front
from trtspec.openai_api.protocol import APIError, parse_request

__all__ = [
    "APIError",
    "Deployment",
    "Front",
    "FrontError",
    "create_app",
    "parse_request",
    "run_with_triton",
    "serve_front",
]
