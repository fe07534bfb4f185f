"""Static checks of a draft/target pair of engine dirs, without loading either (TensorRT-LLM's engine layout).

Both backends write the same `config.json` ({version, pretrained_config, build_config}); a TensorRT-LLM engine dir
holds one `rank{R}.engine` per rank of `pretrained_config.mapping.world_size`, the embedded backend's holds
`rank0.safetensors`. `validate_engines` returns every failed check as a Problem; `trtspec validate engines` prints
them, `trtspec build` runs it on what it built and `trtspec deploy` before it writes a repository.

Checks: the config.json layout; the rank files; the target accepts external draft tokens
(speculative_decoding_mode DRAFT_TOKENS_EXTERNAL, max_draft_len >= K) and does not gather context logits (forbidden
with max_draft_len > 0); the draft has max_draft_len 0; paged context FMHA and a paged KV cache on both (KV-cache
reuse serves the re-sent sequences); generation logits on both and equal vocab sizes when draft logits are used
(they are [K, vocab] tensors); the FP8 quantization algorithms the config asks for, strongly typed; and the engine
version against the runtime (a TensorRT plan runs only under the TensorRT-LLM release that built it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from trtspec import __version__
from trtspec.engine.manifest import SPEC_MODE_DRAFT_TOKENS_EXTERNAL, EngineInfo, read_engine
from trtspec.errors import EngineError, Problem

TORCH_VERSION_PREFIX = "trtspec-torch-"
_RANK_FILE = re.compile(r"^rank(\d+)\.(engine|safetensors)$")
_REBUILD = "rebuild with `trtspec build -c CONFIG`"


@dataclass(frozen=True)
class Expected:
    """What the build config asks of one engine (None: not checked)."""

    quant_algo: str | None = None  # "FP8" or None (unquantized)
    kv_cache_quant_algo: str | None = None
    check_quantization: bool = False


def expected_from_spec(spec) -> Expected:
    """Expectations from a build config's ModelSpec."""
    return Expected(
        "FP8" if spec.quantization == "fp8" else None,
        "FP8" if spec.kv_cache_dtype == "fp8" else None,
        check_quantization=True,
    )


def validate_engines(
    target: str | Path,
    draft: str | Path | None = None,
    *,
    num_draft_tokens: int | None = None,
    use_draft_logits: bool = False,
    expect: dict[str, Expected] | None = None,
    runtime_version: str | None = ...,
) -> list[Problem]:
    """Every failed check of the pair (or of a target alone), [] when it is ready to deploy.

    `runtime_version`: the TensorRT-LLM release engines must match (default: the installed one; None: that check is
    skipped, e.g. on a machine without TensorRT-LLM)."""
    expect = expect or {}
    if runtime_version is ...:
        from trtspec.environment import installed_trtllm

        runtime_version = installed_trtllm().version
    problems: list[Problem] = []
    infos: dict[str, EngineInfo] = {}
    for role, path in (("target", target), ("draft", draft)):
        if path is None:
            continue
        try:
            infos[role] = read_engine(path)
        except EngineError as exc:
            problems.append(Problem(f"{role} layout", str(path), str(exc), _REBUILD))
    for role, info in infos.items():
        problems += _check_files(role, info)
        problems += _check_version(role, info, runtime_version)
        problems += _check_kv_layout(role, info)
        problems += _check_quantization(role, info, expect.get(role))
    t, d = infos.get("target"), infos.get("draft")
    if t is not None:
        problems += _check_target(t, num_draft_tokens)
    if d is not None:
        if d.max_draft_len != 0:
            problems.append(
                Problem(
                    "draft max_draft_len",
                    d.max_draft_len,
                    "must be 0: the draft decodes plainly",
                    "rebuild the draft without --speculative_decoding_mode/--max_draft_len",
                )
            )
    if t is not None and d is not None:
        problems += _check_pair(t, d, use_draft_logits)
    return problems


def _build(info: EngineInfo) -> dict:
    return info.raw.get("build_config") or {}


def _plugins(info: EngineInfo) -> dict:
    return _build(info).get("plugin_config") or {}


def _check_files(role: str, info: EngineInfo) -> list[Problem]:
    ext = "safetensors" if info.backend == "torch" else "engine"
    present = {}
    for p in info.path.iterdir():
        m = _RANK_FILE.match(p.name)
        if m and m.group(2) == ext and p.is_file():
            present[int(m.group(1))] = p
    problems = []
    world = info.world_size
    missing = [f"rank{r}.{ext}" for r in range(world) if r not in present]
    if missing:
        problems.append(
            Problem(
                f"{role} rank files",
                str(info.path),
                f"mapping.world_size is {world} but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                "missing",
                _REBUILD,
            )
        )
    extra = sorted(f"rank{r}.{ext}" for r in present if r >= world)
    if extra:
        problems.append(
            Problem(
                f"{role} rank files",
                str(info.path),
                f"{', '.join(extra)} beyond mapping.world_size {world}: a leftover of another build",
                "remove the dir and rebuild",
            )
        )
    if info.backend == "torch" and world != 1:
        problems.append(
            Problem(f"{role} mapping.world_size", world, "the embedded engine runs in one process", _REBUILD)
        )
    return problems


def _check_version(role: str, info: EngineInfo, runtime_version: str | None) -> list[Problem]:
    if info.backend == "torch":
        expected = f"{TORCH_VERSION_PREFIX}{__version__}"
        if info.version != expected:
            return [
                Problem(
                    f"{role} version",
                    info.version,
                    f"was built by another trtspec; this one reads {expected}",
                    _REBUILD,
                )
            ]
        return []
    from trtspec.environment import UnsupportedVersion, check_trtllm_version

    try:
        check_trtllm_version(info.version)
    except UnsupportedVersion as exc:
        return [Problem(f"{role} version", info.version, str(exc), _REBUILD)]
    if runtime_version is not None and info.version != runtime_version:
        return [
            Problem(
                f"{role} version",
                info.version,
                f"differs from the installed TensorRT-LLM {runtime_version}: TensorRT engines run only under the "
                "release that built them",
                f"{_REBUILD} under TensorRT-LLM {runtime_version}",
            )
        ]
    return []


def _check_kv_layout(role: str, info: EngineInfo) -> list[Problem]:
    problems = []
    plugins = _plugins(info)
    if plugins.get("use_paged_context_fmha") is not True:
        problems.append(
            Problem(
                f"{role} plugin_config.use_paged_context_fmha",
                plugins.get("use_paged_context_fmha"),
                "must be enabled: KV-cache reuse of the re-sent sequence needs paged context FMHA",
                "rebuild with --use_paged_context_fmha enable",
            )
        )
    kv_type = _build(info).get("kv_cache_type")
    paged = str(kv_type).upper() == "PAGED" if kv_type is not None else plugins.get("paged_kv_cache") is True
    if not paged:
        problems.append(
            Problem(
                f"{role} build_config.kv_cache_type",
                kv_type if kv_type is not None else plugins.get("paged_kv_cache"),
                "must be PAGED (block reuse works on the paged KV cache)",
                "rebuild with --kv_cache_type paged",
            )
        )
    return problems


def _check_quantization(role: str, info: EngineInfo, expected: Expected | None) -> list[Problem]:
    problems = []
    if expected is not None and expected.check_quantization:
        for key, want in (("quant_algo", expected.quant_algo), ("kv_cache_quant_algo", expected.kv_cache_quant_algo)):
            have = getattr(info, key)
            if have != want:
                problems.append(
                    Problem(
                        f"{role} pretrained_config.quantization.{key}",
                        have,
                        f"the build config asks for {want}",
                        _REBUILD,
                    )
                )
    if "FP8" in (info.quant_algo, info.kv_cache_quant_algo) and _build(info).get("strongly_typed") is not True:
        problems.append(
            Problem(
                f"{role} build_config.strongly_typed",
                _build(info).get("strongly_typed"),
                "an FP8 engine is strongly typed",
                _REBUILD,
            )
        )
    return problems


def _check_target(t: EngineInfo, num_draft_tokens: int | None) -> list[Problem]:
    problems = []
    if t.speculative_decoding_mode != SPEC_MODE_DRAFT_TOKENS_EXTERNAL:
        problems.append(
            Problem(
                "target build_config.speculative_decoding_mode",
                t.speculative_decoding_mode,
                f"must be DRAFT_TOKENS_EXTERNAL ({SPEC_MODE_DRAFT_TOKENS_EXTERNAL}) to verify external draft tokens",
                "rebuild the target with --speculative_decoding_mode draft_tokens_external",
            )
        )
    needed = max(num_draft_tokens or 0, 1)
    if t.max_draft_len < needed:
        problems.append(
            Problem(
                "target build_config.max_draft_len",
                t.max_draft_len,
                f"must be at least {needed} (the draft length K); TensorRT-LLM otherwise fails each request with "
                f"'Number of draft tokens ({needed}) is larger than maximum number of draft tokens "
                f"({t.max_draft_len})'",
                "rebuild the target with a larger --max_draft_len, or lower K",
            )
        )
    if t.backend == "trtllm" and t.gather_context_logits:  # the embedded engine has no such limit
        problems.append(
            Problem(
                "target build_config.gather_context_logits",
                True,
                "is not supported with max_draft_len > 0 (trtllm-build refuses it)",
                "rebuild without --gather_context_logits",
            )
        )
    return problems


def _check_pair(t: EngineInfo, d: EngineInfo, use_draft_logits: bool) -> list[Problem]:
    problems = []
    if t.backend != d.backend:
        problems.append(
            Problem(
                "draft backend", d.backend, f"differs from the target's '{t.backend}'", "build both with one config"
            )
        )
    if use_draft_logits:
        for role, info in (("target", t), ("draft", d)):
            if not info.gather_generation_logits:
                problems.append(
                    Problem(
                        f"{role} build_config.gather_generation_logits",
                        False,
                        "draft logits need generation logits from both engines",
                        "rebuild with --gather_generation_logits",
                    )
                )
            if info.logits_dtype != "float32":
                # The tensorrtllm backend compares the engine's logits dtype with the declared generation_logits
                # dtype on every response (model_instance_state.cc fillTritonResponse: TLLM_CHECK(generationLogitsType
                # == getLogitsDataType())), and the repository declares FP32; ModelOpt writes float16 for bf16 models.
                problems.append(
                    Problem(
                        f"{role} pretrained_config.logits_dtype",
                        info.logits_dtype,
                        "draft logits are served as FP32 and the tensorrtllm backend fails every response "
                        "whose engine logits have another dtype",
                        "rebuild with trtllm-build --logits_dtype float32 (as `trtspec build` does)",
                    )
                )
        if t.vocab_size != d.vocab_size:
            problems.append(
                Problem(
                    "draft pretrained_config.vocab_size",
                    d.vocab_size,
                    f"differs from the target's {t.vocab_size}: draft logits are [K, vocab_size] tensors",
                    "serve without draft logits (token matching needs equal token ids only), or use a draft with the "
                    "target's vocab",
                )
            )
    return problems


def validate_for_config(loaded, engines_dir: str | Path) -> list[Problem]:
    """The checks for the engines `trtspec build` wrote for a build config (`<engines_dir>/target`, `/draft`)."""
    config = loaded.config
    engines_dir = Path(engines_dir)
    draft = engines_dir / "draft" if config.draft is not None else None
    return validate_engines(
        engines_dir / "target",
        draft,
        num_draft_tokens=config.speculation.num_draft_tokens,
        use_draft_logits=config.speculation.use_draft_logits and draft is not None,
        expect={role: expected_from_spec(spec) for role, spec, _ in loaded.models()},
    )
