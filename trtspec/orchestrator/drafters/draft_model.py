"""Drafting with a small model behind the same engine contract as the target (`tensorrt_llm_draft`)."""

from __future__ import annotations

from trtspec.contract import GenerationRequest, SamplingParams
from trtspec.errors import EngineError
from trtspec.orchestrator.drafters.base import Draft, DraftFailed

# The draft engine seeds its sampler from the request the same way the target does; an offset keeps the
# draft's draws independent of the target's acceptance draws at the same position.
_DRAFT_SEED_OFFSET = 0x5DEECE66D


class DraftModelDrafter:
    def __init__(
        self, client, *, sampling: SamplingParams, end_id: int | None, pad_id: int | None, use_logits: bool = False
    ):
        self.client = client
        self.use_logits = use_logits
        self.end_id, self.pad_id = end_id, pad_id
        seed = None if sampling.seed is None else (sampling.seed + _DRAFT_SEED_OFFSET) % 2**63
        self.sampling = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed)

    def propose(self, context: list[int], k: int) -> Draft:
        # min_tokens = k forces k tokens even past an end token, so the target always gets a full draft. With no end
        # id (-1) there is none to force past, and min_tokens must not go with it (trtspec.orchestrator.loop
        # _verify_request says why).
        try:
            result = self.client.generate(
                GenerationRequest(
                    input_ids=context,
                    request_output_len=k,
                    min_tokens=k if self.end_id is not None and self.end_id >= 0 else 0,
                    end_id=-1 if self.end_id is None else self.end_id,
                    pad_id=self.pad_id,
                    sampling=self.sampling,
                    return_generation_logits=self.use_logits,
                    exclude_input_in_output=True,  # the new tokens alone, not the context again
                )
            )
        except EngineError as exc:  # the draft model failed: speculation is lost, the answer is not
            raise DraftFailed(str(exc)) from exc
        logits = result.generation_logits[:k] if self.use_logits and result.generation_logits is not None else None
        return Draft(result.new_tokens[:k], logits, source="draft_model")

    def observe(self, *, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        pass
