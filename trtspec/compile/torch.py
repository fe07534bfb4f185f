"""The embedded backend's build: HF checkpoint -> FP8 E4M3 weights -> engine dir in TensorRT-LLM's layout.

Per model: load the checkpoint on CPU (GGUF is dequantized by transformers), quantize the decoder's linear
weights to FP8 with ModelOpt-style scales, and write `config.json` (TRT-LLM layout), `rank0.safetensors`,
the tokenizer and, last, `manifest.json`. A model whose inputs and settings are unchanged is skipped.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from trtspec import __version__
from trtspec.checkpoint import GENERATION_CONFIG, CheckpointInfo, load_model, load_tokenizer
from trtspec.compile.common import (
    atomic_dir,
    describe_outputs,
    describe_sources,
    fingerprint,
    is_up_to_date,
    write_json,
)
from trtspec.config import BuildConfig, LoadedConfig, ModelSpec
from trtspec.engine import fp8
from trtspec.engine.manifest import (
    CONFIG_FILE,
    MANIFEST_FILE,
    SPEC_MODE_DRAFT_TOKENS_EXTERNAL,
    SPEC_MODE_NONE,
    read_manifest,
)
from trtspec.errors import TrtspecError

WEIGHTS_FILE = "rank0.safetensors"
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class ModelBuild:
    """One engine to build: what goes in, where it goes, and whether it is already there."""

    role: str  # "target" or "draft"
    spec: ModelSpec
    info: CheckpointInfo
    output: Path
    settings: dict
    sources: list[dict] | None = None
    up_to_date: bool = False

    def describe(self) -> str:
        quant = f"FP8 {self.spec.fp8_scaling.replace('_', ' ')}" if self.spec.quantization == "fp8" else "unquantized"
        if self.spec.quantize_lm_head:
            quant += ", output head too"
        return f"{self.role}: {self.info.path} ({self.info.architecture}) -> {self.output} [{self.spec.dtype}, {quant}]"


def plan(loaded: LoadedConfig, output_dir: Path, *, check_existing: bool = True) -> list[ModelBuild]:
    builds = []
    for role, spec, info in loaded.models():
        out = output_dir / role
        if out.exists() and read_manifest(out) is None and any(out.iterdir()):
            raise TrtspecError(
                f"{out} exists and is not an engine dir written by trtspec; choose another --output or remove it"
            )
        build = ModelBuild(role, spec, info, out, engine_settings(loaded.config, role))
        if check_existing:
            build.sources = describe_sources(info)
            build.up_to_date = is_up_to_date(out, fingerprint(build.sources, build.settings))
        builds.append(build)
    return builds


def engine_settings(config: BuildConfig, role: str) -> dict:
    """Everything of the config that changes this role's engine (the rebuild key)."""
    spec = getattr(config, role)
    return {
        "backend": "torch",
        "role": role,
        "trtspec": __version__,
        "model": spec.model_dump(exclude={"checkpoint"}),
        "engine": config.engine.model_dump(),
        "speculation": config.speculation.model_dump(),
    }


def build_model(build: ModelBuild, config: BuildConfig, progress=None) -> dict:
    """Build one engine dir; returns its manifest."""
    spec = build.spec
    dtype = TORCH_DTYPES[spec.dtype]
    durations: dict[str, float] = {}

    def step(name: str, fn):
        if progress:
            progress(f"{build.role}: {name}")
        start = time.perf_counter()
        result = fn()
        durations[name] = round(time.perf_counter() - start, 3)
        return result

    if build.sources is None:
        build.sources = step("hash sources", lambda: describe_sources(build.info))
    model = step("load checkpoint", lambda: load_model(build.info, dtype, trust_remote_code=spec.trust_remote_code))
    state = _unique_state_dict(model)
    if spec.quantization == "fp8":
        state = step(
            "quantize fp8",
            lambda: fp8.quantize_state_dict(
                state, per_channel=spec.fp8_scaling == "per_channel", lm_head=spec.quantize_lm_head
            ),
        )
    tokenizer = _maybe_tokenizer(build.info, spec)
    with atomic_dir(build.output) as scratch:

        def write():
            save_file(
                {k: v.contiguous() for k, v in state.items()},
                str(scratch / WEIGHTS_FILE),
                metadata={
                    "format": "pt",
                    "quantization": spec.quantization,
                    "fp8_scaling": spec.fp8_scaling,
                    "quantize_lm_head": str(spec.quantize_lm_head).lower(),
                },
            )
            write_json(scratch / CONFIG_FILE, engine_config(build, config, model.config, tokenizer))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(scratch))
            generation = Path(build.info.path) / GENERATION_CONFIG
            if generation.is_file():  # its end ids, which the BLS stops on (trtspec.checkpoint.declared_end_ids)
                shutil.copyfile(generation, scratch / GENERATION_CONFIG)

        step("write engine", write)
        manifest = {
            "trtspec": __version__,
            "backend": "torch",
            "role": build.role,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "fingerprint": fingerprint(build.sources, build.settings),
            "settings": build.settings,
            "sources": build.sources,
            "outputs": describe_outputs(scratch),
            "durations_s": durations,
        }
        write_json(scratch / MANIFEST_FILE, manifest)
    return manifest


def _unique_state_dict(model) -> dict[str, torch.Tensor]:
    """The state dict without tied duplicates (safetensors refuses shared storage; ties are restored at load)."""
    seen, state = set(), {}
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        state[name] = tensor.detach()
    return state


def _maybe_tokenizer(info: CheckpointInfo, spec: ModelSpec):
    return load_tokenizer(info, trust_remote_code=spec.trust_remote_code) if info.has_tokenizer else None


def engine_config(build: ModelBuild, config: BuildConfig, hf_config, tokenizer) -> dict:
    """config.json in TensorRT-LLM's engine layout (EngineConfig.to_dict), plus a `trtspec` section."""
    spec, eng, spec_cfg = build.spec, config.engine, config.speculation
    is_target = build.role == "target"
    max_draft_len = spec_cfg.max_draft_len if is_target else 0
    fp8_weights = spec.quantization == "fp8"
    fp8_kv = spec.kv_cache_dtype == "fp8"
    hf = hf_config.to_dict()
    for key in ("quantization_config", "torch_dtype", "dtype", "_name_or_path", "transformers_version"):
        hf.pop(key, None)
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    eos = eos if eos is not None else _first(hf.get("eos_token_id"))
    return {
        "version": f"trtspec-torch-{__version__}",
        "pretrained_config": {
            "architecture": build.info.architecture,
            "dtype": spec.dtype,
            "logits_dtype": "float32",
            "vocab_size": hf_config.vocab_size,
            "hidden_size": hf_config.hidden_size,
            "num_hidden_layers": hf_config.num_hidden_layers,
            "num_attention_heads": hf_config.num_attention_heads,
            "num_key_value_heads": getattr(hf_config, "num_key_value_heads", hf_config.num_attention_heads),
            "max_position_embeddings": hf_config.max_position_embeddings,
            "hidden_act": getattr(hf_config, "hidden_act", None),
            "mapping": {
                "world_size": 1,
                "tp_size": 1,
                "pp_size": 1,
                "cp_size": 1,
                "gpus_per_node": 8,
                "moe_tp_size": 1,
                "moe_ep_size": 1,
            },
            "quantization": {
                "quant_algo": "FP8" if fp8_weights else None,
                "kv_cache_quant_algo": "FP8" if fp8_kv else None,
                "group_size": 128,
            },
        },
        "build_config": {
            "max_input_len": eng.max_input_len,
            # TRT-LLM's build() adds max_draft_len to max_seq_len on a speculative target; so does this layout.
            "max_seq_len": eng.max_seq_len + max_draft_len,
            "max_batch_size": eng.max_batch_size,
            "max_beam_width": 1,
            "max_num_tokens": max(8192, eng.max_batch_size * (max_draft_len + 1)),
            "kv_cache_type": "PAGED",
            "gather_context_logits": config.gathers_context_logits(build.role),
            "gather_generation_logits": config.gathers_generation_logits(build.role),
            "strongly_typed": True,
            "max_draft_len": max_draft_len,
            "speculative_decoding_mode": SPEC_MODE_DRAFT_TOKENS_EXTERNAL if is_target else SPEC_MODE_NONE,
            "plugin_config": {
                "dtype": spec.dtype,
                "paged_kv_cache": True,
                "tokens_per_block": 32,
                "use_paged_context_fmha": True,
                "use_fp8_context_fmha": fp8_weights and fp8_kv,
                "context_fmha": True,
                "remove_input_padding": True,
            },
        },
        "trtspec": {
            "backend": "torch",
            "role": build.role,
            "weights": WEIGHTS_FILE,
            "kv_cache_mb": eng.kv_cache_mb,
            "kv_cache_reuse_mb": eng.kv_cache_reuse_mb,
            "eos_token_id": eos,
            "pad_token_id": pad if pad is not None else eos,
            "hf_config": hf,
        },
    }


def _first(value):
    return value[0] if isinstance(value, list) and value else value
