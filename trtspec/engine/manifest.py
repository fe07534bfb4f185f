"""Engine directories: the TensorRT-LLM `config.json` layout, shared by both backends, and the build manifest.

A TensorRT-LLM engine dir holds `config.json` = {version, pretrained_config, build_config} and one
`rank{R}.engine` per rank. The embedded backend writes the same `config.json` (plus a `trtspec` section with
the Hugging Face config it needs to rebuild the network) and `rank0.safetensors` instead of a TensorRT plan,
so one reader and one set of checks serve both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from trtspec.errors import EngineError

CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"  # written last: an engine dir without it is incomplete

# SpeculativeDecodingMode is an IntFlag in TensorRT-LLM (modeling_utils.py): NONE=1, DRAFT_TOKENS_EXTERNAL=2.
SPEC_MODE_NONE = 1
SPEC_MODE_DRAFT_TOKENS_EXTERNAL = 2
_SPEC_MODE_NAMES = {"NONE": SPEC_MODE_NONE, "DRAFT_TOKENS_EXTERNAL": SPEC_MODE_DRAFT_TOKENS_EXTERNAL}


@dataclass(frozen=True)
class EngineInfo:
    """The fields of an engine's config.json that trtspec acts on."""

    path: Path
    raw: dict
    backend: str  # "torch" (embedded) or "trtllm"
    version: str
    architecture: str
    dtype: str
    vocab_size: int
    world_size: int
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    max_batch_size: int
    max_input_len: int
    max_seq_len: int  # as stored: includes max_draft_len on a speculative target
    max_draft_len: int
    speculative_decoding_mode: int
    gather_generation_logits: bool
    gather_context_logits: bool
    logits_dtype: str = "float32"  # pretrained_config.logits_dtype (TensorRT-LLM's PretrainedConfig default)

    @property
    def accepts_draft_tokens(self) -> bool:
        return self.speculative_decoding_mode == SPEC_MODE_DRAFT_TOKENS_EXTERNAL and self.max_draft_len > 0

    @property
    def max_output_seq_len(self) -> int:
        """The longest prompt + output, as the user asked at build time (TRT-LLM adds max_draft_len)."""
        return self.max_seq_len - (self.max_draft_len if self.accepts_draft_tokens else 0)


def speculative_mode_value(value) -> int:
    """TRT-LLM stores the mode as an int; older and hand-written configs may use its name."""
    if isinstance(value, str):
        key = value.upper()
        if key not in _SPEC_MODE_NAMES:
            raise ValueError(f"unknown speculative_decoding_mode {value!r}")
        return _SPEC_MODE_NAMES[key]
    return int(value)


def read_engine(path: str | Path) -> EngineInfo:
    """Read and check an engine dir's config.json; raises EngineError naming the file and the key."""
    path = Path(path)
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise EngineError(f"{path} is not an engine dir: {CONFIG_FILE} is missing (build it with `trtspec build`)")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise EngineError(f"{config_path} is not valid JSON: {exc}") from exc
    return engine_info(path, raw)


def engine_info(path: str | Path, raw: dict) -> EngineInfo:
    """An engine's facts from its config.json contents `raw` (read from `path`, or kept elsewhere)."""
    path = Path(path)
    config_path = path / CONFIG_FILE

    def get(*keys, default=...):
        node = raw
        for key in keys:
            if not isinstance(node, dict) or key not in node:
                if default is not ...:
                    return default
                raise EngineError(
                    f"{config_path}: missing '{'.'.join(keys)}' (not a TensorRT-LLM engine config.json layout)"
                )
            node = node[key]
        return node

    quant = get("pretrained_config", "quantization", default={}) or {}
    try:
        return EngineInfo(
            path=path,
            raw=raw,
            backend=get("trtspec", "backend", default="trtllm"),
            version=str(get("version")),
            architecture=get("pretrained_config", "architecture"),
            dtype=get("pretrained_config", "dtype"),
            vocab_size=int(get("pretrained_config", "vocab_size")),
            world_size=int(get("pretrained_config", "mapping", "world_size", default=1)),
            quant_algo=quant.get("quant_algo"),
            kv_cache_quant_algo=quant.get("kv_cache_quant_algo"),
            max_batch_size=int(get("build_config", "max_batch_size")),
            max_input_len=int(get("build_config", "max_input_len")),
            max_seq_len=int(get("build_config", "max_seq_len")),
            max_draft_len=int(get("build_config", "max_draft_len", default=0)),
            speculative_decoding_mode=speculative_mode_value(
                get("build_config", "speculative_decoding_mode", default=SPEC_MODE_NONE)
            ),
            gather_generation_logits=bool(get("build_config", "gather_generation_logits", default=False)),
            gather_context_logits=bool(get("build_config", "gather_context_logits", default=False)),
            logits_dtype=str(get("pretrained_config", "logits_dtype", default="float32")),
        )
    except (TypeError, ValueError) as exc:
        raise EngineError(f"{config_path}: {exc}") from exc


def read_manifest(path: str | Path) -> dict | None:
    """The build manifest, or None when the dir is missing one (an unfinished or foreign build)."""
    manifest = Path(path) / MANIFEST_FILE
    try:
        return json.loads(manifest.read_text())
    except (OSError, json.JSONDecodeError):
        return None
