"""What the tests share: tiny models (tiny), TensorRT-LLM's engine layout (trtllm_layout), the strict stand-in of
TensorRT-LLM's Triton backend (tensorrtllm_standin, standin_repo) and engine models that misbehave on purpose
(failing_engine, late_engine, paced_engine), and the BLS request generator (fuzzing)."""
