"""TensorRT-LLM engine dirs and Hugging Face configs as the tests need them, without TensorRT-LLM or weights.

Engine dirs follow the documented layout (TensorRT-LLM `Engine.save` / `EngineConfig.to_dict`, late 1.x): `config.json`
= {"version", "pretrained_config", "build_config"} and one `rank{R}.engine` per rank of `mapping.world_size` (here a
few placeholder bytes: nothing loads them). `speculative_decoding_mode` is the IntFlag value (NONE 1,
DRAFT_TOKENS_EXTERNAL 2); the target's max_seq_len includes max_draft_len, as build() stores it.

HF_CONFIGS are the published config.json values of the example configs' models (build_configs/hf/, from each model's
Hugging Face repository: meta-llama/Llama-3.1-70B-Instruct, meta-llama/Llama-3.2-1B-Instruct,
meta-llama/Llama-3.1-405B-Instruct, meta-llama/Llama-3.1-8B-Instruct, Qwen/Qwen2.5-14B-Instruct,
Qwen/Qwen2.5-0.5B-Instruct).
"""

from __future__ import annotations

import json
from pathlib import Path

HF_DIR = Path(__file__).resolve().parents[2] / "build_configs" / "hf"


def hf_config(name: str) -> dict:
    data = json.loads((HF_DIR / f"{name}.json").read_text())
    data.pop("_source", None)
    return data


def write_checkpoint(path: Path, name: str, *, weights: bool = False, tokenizer: Path | None = None) -> Path:
    """A checkpoint dir with the model's config.json (and, with `weights`, a placeholder safetensors file)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(name)))
    if weights:
        (path / "model.safetensors").write_bytes(b"\0" * 16)
    if tokenizer is not None:
        (path / "tokenizer.json").write_text(tokenizer.read_text())
    return path


def engine_config(
    *,
    version: str = "1.2.1",
    role: str = "target",
    hf: dict | None = None,
    tp_size: int = 1,
    pp_size: int = 1,
    max_draft_len: int = 10,
    max_batch_size: int = 16,
    max_input_len: int = 8191,
    max_seq_len: int = 8192,
    fp8: bool = True,
    fp8_kv: bool = True,
    gather_generation_logits: bool = False,
    vocab_size: int | None = None,
) -> dict:
    hf = hf or hf_config("Llama-3.2-1B-Instruct")
    target = role == "target"
    draft_len = max_draft_len if target else 0
    heads = hf["num_attention_heads"]
    return {
        "version": version,
        "pretrained_config": {
            "architecture": hf["architectures"][0],
            "dtype": "bfloat16",
            "logits_dtype": "float32",
            "vocab_size": vocab_size or hf["vocab_size"],
            "hidden_size": hf["hidden_size"],
            "num_hidden_layers": hf["num_hidden_layers"],
            "num_attention_heads": heads,
            "num_key_value_heads": hf.get("num_key_value_heads", heads),
            "head_size": hf.get("head_dim", hf["hidden_size"] // heads),
            "intermediate_size": hf["intermediate_size"],
            "max_position_embeddings": hf["max_position_embeddings"],
            "mapping": {
                "world_size": tp_size * pp_size,
                "tp_size": tp_size,
                "pp_size": pp_size,
                "cp_size": 1,
                "gpus_per_node": 8,
                "moe_tp_size": tp_size,
                "moe_ep_size": 1,
            },
            "quantization": {
                "quant_algo": "FP8" if fp8 else None,
                "kv_cache_quant_algo": "FP8" if fp8_kv else None,
                "group_size": 128,
                "exclude_modules": ["lm_head"],
            },
        },
        "build_config": {
            "max_input_len": max_input_len,
            "max_seq_len": max_seq_len + draft_len,
            "opt_batch_size": 8,
            "max_batch_size": max_batch_size,
            "max_beam_width": 1,
            "max_num_tokens": 8192,
            "kv_cache_type": "PAGED",
            "gather_context_logits": False,
            "gather_generation_logits": gather_generation_logits,
            "strongly_typed": True,
            "max_draft_len": draft_len,
            "speculative_decoding_mode": 2 if target else 1,
            "plugin_config": {
                "dtype": "bfloat16",
                "gpt_attention_plugin": "bfloat16",
                "gemm_plugin": "fp8" if fp8 else "bfloat16",
                "context_fmha": True,
                "paged_kv_cache": True,
                "remove_input_padding": True,
                "tokens_per_block": 32,
                "use_paged_context_fmha": True,
                "use_fp8_context_fmha": fp8 and fp8_kv,
                "use_fused_mlp": True,
            },
        },
    }


def write_engine(path: Path, config: dict, *, tokenizer: Path | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for rank in range(config["pretrained_config"]["mapping"]["world_size"]):
        (path / f"rank{rank}.engine").write_bytes(b"plan")
    if tokenizer is not None:
        (path / "tokenizer.json").write_text(tokenizer.read_text())
    return path
