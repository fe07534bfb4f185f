"""A repository whose engine models are the strict stand-in of TensorRT-LLM's `tensorrtllm` backend
(tests/support/tensorrtllm_standin.py): the embedded engines, configured exactly as `trtspec deploy` configures
TensorRT engines (the tensorrt_llm_trtllm template), with `backend: "python"` and the stand-in as model.py."""

from __future__ import annotations

import shutil
from pathlib import Path

from trtspec.config import load_config
from trtspec.deploy.writer import (
    CONFIG_FILE,
    DRAFT_MODEL,
    ENGINE_TEMPLATES,
    TARGET_MODEL,
    TEMPLATES_DIR,
    Raw,
    _apply_overrides,
    render,
    template_values,
    write_repository,
)
from trtspec.engine.manifest import read_engine

STANDIN = Path(__file__).parent / "tensorrtllm_standin.py"


def write_standin_repository(config_path, engines: Path, out: Path, *, edit=None, **kw) -> Path:
    """`trtspec deploy` for the embedded engines, then each engine model replaced by the stand-in under the
    TensorRT-LLM engine config; `edit(text) -> text` may break that config (to test refusals)."""
    repo = write_repository(load_config(config_path), engines, out, **kw)
    config = load_config(config_path).config
    target = read_engine(engines / "target")
    draft = read_engine(engines / "draft") if (engines / "draft").is_dir() else None
    values = template_values(config, target, draft, device="cpu")
    _apply_overrides(values, kw.get("overrides") or {})  # decoupled_mode among them, as deploy applies them
    for name, info in ((TARGET_MODEL, target), (DRAFT_MODEL, draft)):
        if info is None:
            continue
        text = render(
            TEMPLATES_DIR / ENGINE_TEMPLATES["trtllm"] / CONFIG_FILE,
            {
                **values,
                "model_name": name,
                "engine_dir": str(info.path),
                "gpu_device_ids": "0",
                "kv_cache_free_gpu_mem_fraction": "0.9",
                "trtllm_extra_parameters": Raw(""),
            },
        )
        text = text.replace('backend: "tensorrtllm"', 'backend: "python"')
        (repo / name / CONFIG_FILE).write_text(edit(text) if edit else text)
        shutil.copy(STANDIN, repo / name / "1" / "model.py")
    return repo
