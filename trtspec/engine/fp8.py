"""FP8 E4M3 weight quantization with the scales of ModelOpt's FP8 recipe.

scale = amax / 448 (448 is E4M3's largest finite value), q = cast_e4m3(w / scale), w ≈ q * scale.
Per tensor by default (one scale per weight, as ModelOpt's FP8_DEFAULT_CFG); per channel keeps one scale
per output row. E4M3 has a 3-bit mantissa, so round-to-nearest gives a relative error of at most 2^-4
for values in the normal range.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
SCALE_SUFFIX = ".weight_scale"  # ModelOpt's name for a weight's dequantization scale


def quantize(weight: torch.Tensor, *, per_channel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (fp8 weight, fp32 scale); scale has shape [] per tensor or [out, 1] per channel."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    # An all-zero row or tensor would give scale 0 and NaN on division; any positive scale is exact there.
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return q, scale.to(torch.float32)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(torch.float32) * scale).to(dtype)


HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


def is_quantizable(name: str, tensor: torch.Tensor, *, lm_head: bool = False) -> bool:
    """The linear weights of the decoder layers, as ModelOpt quantizes them: not the embeddings or norms, and the
    output head only when asked (its `quantize_lm_head` defaults to off)."""
    if name == HEAD:
        return lm_head and tensor.ndim == 2
    return tensor.ndim == 2 and name.endswith(".weight") and ".layers." in name and "norm" not in name


def quantize_state_dict(
    state: dict[str, torch.Tensor], *, per_channel: bool, lm_head: bool = False
) -> dict[str, torch.Tensor]:
    """The state with its quantizable weights as FP8 codes and scales. With `lm_head`, a head tied to the embedding
    (stored once, as the embedding) gets an FP8 copy of its own: the embedding itself stays as it is."""
    if lm_head and HEAD not in state and EMBEDDING in state:
        state = {**state, HEAD: state[EMBEDDING]}
    out = {}
    for name, tensor in state.items():
        if is_quantizable(name, tensor, lm_head=lm_head):
            out[name], out[name.removesuffix(".weight") + SCALE_SUFFIX] = quantize(tensor, per_channel=per_channel)
        else:
            out[name] = tensor
    return out


def dequantize_state_dict(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if tensor.dtype == FP8_DTYPE:
            scale = state.get(name.removesuffix(".weight") + SCALE_SUFFIX)
            if scale is None:
                raise KeyError(f"{name} is FP8 but its scale {name.removesuffix('.weight') + SCALE_SUFFIX} is missing")
            out[name] = dequantize(tensor, scale, dtype)
        else:
            out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return out
