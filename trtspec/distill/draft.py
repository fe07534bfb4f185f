"""The draft model: a few decoder layers of the target's architecture on the target's embeddings and head.

- layers: `num_layers` decoder layers, initialised from chosen target layers (`--init from-target`: the first
  num_layers - 1 and the last, so the draft starts with the target's input-side features and its output-side
  mapping into the head's space) or at random (`--init random`, the architecture's own initialisation);
- embeddings: the target's, frozen and shared (not stored in the asset);
- final norm: starts as the target's and is trained (the draft's own, 1 x hidden);
- head: the target's head rows of the N tokens the target emits most (`SubsetHead`, frozen and shared), or the
  whole target head (tied) when N is the vocabulary.

`write_asset` stores only the draft's own tensors, in bf16, with `trtspec_shared.json` naming the rest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from trtspec.checkpoint import (
    SHARED_FILE,
    SHARED_FORMAT,
    SUPPORTED_ARCHITECTURES,
    CheckpointInfo,
)
from trtspec.distill.data import DistillError
from trtspec.engine import subset_head

SHARED_TENSORS = ("model.embed_tokens.weight",)
ASSET_WEIGHTS = "model.safetensors"


def check_distillable(info: CheckpointInfo, config) -> None:
    """A target the draft can be made from: a supported decoder-only architecture with the Llama module layout."""
    if info.shared is not None:
        raise DistillError(
            f"--target {info.path} is itself a draft that takes weights from another checkpoint; "
            "distill from a complete checkpoint"
        )
    if info.architecture not in SUPPORTED_ARCHITECTURES:
        raise DistillError(
            f"--target {info.path}: architecture {info.architecture} cannot be distilled; "
            f"trtspec distills {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if not getattr(config, key, None):
            raise DistillError(f"--target {info.path}: its config has no {key}")


def default_layers(num_target_layers: int, num_layers: int) -> list[int]:
    """The target layers a from-target draft starts from: the first num_layers - 1, then the last."""
    if num_layers < 1:
        raise DistillError(f"--layers must be at least 1, got {num_layers}")
    if num_layers >= num_target_layers:
        raise DistillError(
            f"--layers {num_layers}: the target has only {num_target_layers} layers; a draft must be smaller"
        )
    return list(range(num_layers - 1)) + [num_target_layers - 1]


def draft_config(target_config, architecture: str, layers: list[int], head_ids: torch.Tensor | None):
    """The draft's Hugging Face config: the target's with fewer layers (and a subset head when head_ids is given)."""
    config = target_config.__class__.from_dict(_clean(target_config.to_dict()))
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [target_config.layer_types[i] for i in layers]
    if head_ids is not None:
        config.tie_word_embeddings = False
        setattr(config, subset_head.CONFIG_KEY, int(head_ids.numel()))
    config.architectures = [architecture]  # a GGUF-loaded config has none
    return config


def _clean(config: dict) -> dict:
    for key in ("quantization_config", "_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        config.pop(key, None)
    return config


def make_draft(target, layers: list[int], *, init: str, head_ids: torch.Tensor | None, seed: int):
    """A float32 draft built from the target model (already loaded): see the module doc."""
    from transformers import AutoModelForCausalLM

    config = draft_config(target.config, type(target).__name__, layers, head_ids)
    torch.manual_seed(seed)
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    subset_head.install(draft)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight.float())
        draft.model.norm.weight.copy_(target.model.norm.weight.float())
        if init == "from-target":
            for mine, theirs in zip(draft.model.layers, (target.model.layers[i] for i in layers)):
                mine.load_state_dict({k: v.float() for k, v in theirs.state_dict().items()})
        if head_ids is not None:
            draft.lm_head.token_ids.copy_(head_ids)
            draft.lm_head.weight.copy_(target.get_output_embeddings().weight[head_ids].float())
        elif not _tied(draft):
            draft.lm_head.weight.copy_(target.get_output_embeddings().weight.float())
    draft.tie_weights()
    draft.model.embed_tokens.weight.requires_grad_(False)
    draft.lm_head.weight.requires_grad_(False)
    return draft


def load_own_state(draft, state: dict[str, torch.Tensor], source: str) -> None:
    """Put a written draft's own tensors (`own_state`, as `write_asset` stored them) into a fresh one of the same
    shape: training goes on from there."""
    own = own_state(draft)
    if set(state) != set(own):
        raise DistillError(
            f"--init-from {source}: its tensors do not make up this draft (differs in "
            f"{sorted(set(state) ^ set(own))[:3]}); give a draft distilled for this target"
        )
    with torch.no_grad():
        for name, tensor in draft.state_dict().items():
            if name in state:
                if tuple(state[name].shape) != tuple(tensor.shape):
                    raise DistillError(
                        f"--init-from {source}: {name} has shape {tuple(state[name].shape)}, "
                        f"this target's draft needs {tuple(tensor.shape)}"
                    )
                tensor.copy_(state[name].to(tensor.dtype))


def _tied(model) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False))


def choose_head(counts: torch.Tensor, num_tokens: int, always: list[int]) -> torch.Tensor | None:
    """The `num_tokens` most frequent target tokens (plus `always`, e.g. the end token), sorted by id;
    None when that is the whole vocabulary. Equal counts (tokens the data never showed, most of all) rank by
    lower id first: in a BPE vocabulary ids follow merge order, which follows frequency in the tokenizer's corpus."""
    vocab = counts.numel()
    if num_tokens <= 0 or num_tokens >= vocab:
        return None
    chosen = set(t for t in always if 0 <= t < vocab)
    for t in counts.argsort(descending=True, stable=True).tolist():
        if len(chosen) >= num_tokens:
            break
        chosen.add(t)
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def own_state(draft) -> dict[str, torch.Tensor]:
    """The draft's tensors that are not the target's (see SHARED_TENSORS and the subset head's rows)."""
    shared = set(SHARED_TENSORS) | set(_shared_head(draft)) | ({"lm_head.weight"} if _tied(draft) else set())
    return {name: t.detach().cpu() for name, t in draft.state_dict().items() if name not in shared}


def _shared_head(draft) -> dict[str, dict]:
    if isinstance(draft.lm_head, subset_head.SubsetHead):
        return {"lm_head.weight": {"from": "lm_head.weight", "rows": "lm_head.token_ids"}}
    return {} if _tied(draft) else {"lm_head.weight": {"from": "lm_head.weight"}}  # tied: it is the embeddings


def write_asset(draft, output: Path, target_spec: str, *, dtype=torch.bfloat16, metadata: dict | None = None) -> None:
    """config.json, model.safetensors (own tensors only) and trtspec_shared.json, each replaced atomically."""
    from safetensors.torch import save_file

    output.mkdir(parents=True, exist_ok=True)
    state = {
        n: (t.to(dtype) if t.is_floating_point() else t.to(torch.int64)).contiguous()
        for n, t in own_state(draft).items()
    }
    config = _clean(draft.config.to_dict())
    config["dtype"] = str(dtype).removeprefix("torch.")
    shared = {
        "format": SHARED_FORMAT,
        "target": target_spec,
        "tensors": {name: {"from": name} for name in SHARED_TENSORS} | _shared_head(draft),
    }
    _atomic(output / ASSET_WEIGHTS, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    _atomic(output / "config.json", lambda p: p.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n"))
    _atomic(output / SHARED_FILE, lambda p: p.write_text(json.dumps(shared, indent=2) + "\n"))
    if metadata is not None:
        _atomic(output / "distill.json", lambda p: p.write_text(json.dumps(metadata, indent=2) + "\n"))


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)
