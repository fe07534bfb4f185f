"""`trtspec build` on the tiny pair: TRT-LLM's engine layout, FP8 weights within E4M3's error bound, the
manifest, skip-if-unchanged, dry runs, and failures that leave nothing half-built behind."""

from __future__ import annotations

import io
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import ENGINE, MAX_DRAFT_LEN, MAX_SEQ_LEN, SPECULATION
from rich.console import Console
from safetensors import safe_open
from safetensors.torch import load_file
from support.tiny import write_config

from trtspec.checkpoint import declared_end_ids
from trtspec.cli import cli
from trtspec.compile import run_build
from trtspec.compile.common import atomic_dir, sha256_file
from trtspec.engine import fp8
from trtspec.engine.manifest import SPEC_MODE_DRAFT_TOKENS_EXTERNAL, SPEC_MODE_NONE, read_engine, read_manifest
from trtspec.errors import CheckpointError, TrtspecError

# E4M3: 3 mantissa bits, min normal 2^-6, subnormal step 2^-9, max 448. Round to nearest, in units of the
# scale: for |x| >= 2^-6 the spacing is <= 2^-3 |x|, so the error is <= 2^-4 |x|; below 2^-6 the spacing is
# 2^-9, so the error is <= 2^-10. In weight units (w = x * scale): |w - deq| <= max(2^-4 |w|, 2^-10 scale).
REL_BOUND = 2.0**-4
SUBNORMAL_BOUND = 2.0**-10
FLOAT32_SLACK = 1e-6  # the float32 division by and multiplication with the scale


def e4m3_bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.maximum(REL_BOUND * w.abs(), SUBNORMAL_BOUND * scale) + FLOAT32_SLACK * w.abs()


def check_fp8_error(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> dict[str, float]:
    """Assert the bound element-wise; return how close the error comes to it (to show it is not vacuous)."""
    w = w.float()
    deq = fp8.dequantize(q, scale, torch.float32)
    err = (w - deq).abs()
    bound = e4m3_bound(w, scale)
    worst = torch.argmax(err - bound)
    assert torch.all(err <= bound), (
        f"E4M3 bound broken at {worst}: |w - deq| = {err.flatten()[worst]}, bound {bound.flatten()[worst]}"
    )
    x = (w / scale).abs()
    normal, subnormal = x >= 2.0**-6, (x < 2.0**-6) & (x > 0)
    return {
        "normal_rel": float((err[normal] / w.abs()[normal]).max()) if normal.any() else 0.0,
        "subnormal_abs": float((err / scale)[subnormal].max()) if subnormal.any() else 0.0,
    }


# ---- FP8 quantization itself --------------------------------------------------------------------------------


def wide_range_weight(rows: int = 96, cols: int = 128, seed: int = 0) -> torch.Tensor:
    """Magnitudes spread over 2^-24..1 so that both E4M3's normal and subnormal ranges are hit."""
    g = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0)
    return sign * torch.exp2(-24 * torch.rand(rows, cols, generator=g))


def test_fp8_per_tensor_error_within_e4m3_bound():
    w = wide_range_weight()
    q, scale = fp8.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == () and scale.dtype == torch.float32
    assert scale == pytest.approx(float(w.abs().max()) / 448.0, rel=1e-6)
    assert float(q.float().abs().max()) == 448.0  # amax maps to E4M3's largest value
    seen = check_fp8_error(w, q, scale)
    # the bound is attained up to rounding: the format really has 3 mantissa bits, and subnormals are used
    assert 2.0**-5 < seen["normal_rel"] <= REL_BOUND * (1 + 1e-5)
    assert 0.9 * SUBNORMAL_BOUND < seen["subnormal_abs"] <= SUBNORMAL_BOUND * (1 + 1e-5)


def test_fp8_per_channel_error_within_e4m3_bound():
    w = wide_range_weight(seed=1) * torch.logspace(-6, 2, 96).unsqueeze(1)  # rows 8 decades apart
    w[5] = 0.0  # an all-zero row
    q, scale = fp8.quantize(w, per_channel=True)
    assert scale.shape == (96, 1)
    assert scale[5, 0] == 1.0 and torch.all(q[5].float() == 0)
    torch.testing.assert_close(scale[:, 0], torch.where(w.abs().amax(1) > 0, w.abs().amax(1) / 448.0, 1.0))
    seen = check_fp8_error(w, q, scale)
    assert 2.0**-5 < seen["normal_rel"] and 0.9 * SUBNORMAL_BOUND < seen["subnormal_abs"]
    # per tensor, the small rows would be lost to the one scale; per channel keeps each row's precision
    q_t, scale_t = fp8.quantize(w)
    assert torch.count_nonzero(q_t[:10].float()) < torch.count_nonzero(q[:10].float()) // 2


def test_fp8_state_dict_round_trip():
    state = {
        "model.embed_tokens.weight": torch.randn(10, 4),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(4),
        "model.layers.0.input_layernorm.weight": torch.randn(4),
        "lm_head.weight": torch.randn(10, 4),
    }
    q = fp8.quantize_state_dict(state, per_channel=False)
    assert {k for k, v in q.items() if v.dtype == fp8.FP8_DTYPE} == {"model.layers.0.self_attn.q_proj.weight"}
    assert "model.layers.0.self_attn.q_proj.weight_scale" in q
    deq = fp8.dequantize_state_dict(q, torch.float32)
    assert set(deq) == set(state)
    for name in state:
        if name != "model.layers.0.self_attn.q_proj.weight":
            assert torch.equal(deq[name], state[name])
    del q["model.layers.0.self_attn.q_proj.weight_scale"]
    with pytest.raises(KeyError, match="weight_scale"):
        fp8.dequantize_state_dict(q, torch.float32)


# ---- the engine dirs ----------------------------------------------------------------------------------------


def test_engine_config_has_the_trtllm_layout(built_fp8):
    target = json.loads((built_fp8.target / "config.json").read_text())
    draft = json.loads((built_fp8.draft / "config.json").read_text())
    for cfg, arch in ((target, "LlamaForCausalLM"), (draft, "Qwen2ForCausalLM")):
        assert isinstance(cfg["version"], str) and cfg["version"]
        pre = cfg["pretrained_config"]
        assert pre["architecture"] == arch
        assert pre["dtype"] == "float32"
        assert pre["vocab_size"] == 320
        assert pre["mapping"]["world_size"] == 1
        assert pre["quantization"]["quant_algo"] == "FP8"
        assert pre["quantization"]["kv_cache_quant_algo"] == "FP8"
        assert cfg["build_config"]["max_input_len"] == ENGINE["max_input_len"]
        assert cfg["build_config"]["max_batch_size"] == ENGINE["max_batch_size"]
    assert target["build_config"]["max_draft_len"] == MAX_DRAFT_LEN
    assert target["build_config"]["speculative_decoding_mode"] == SPEC_MODE_DRAFT_TOKENS_EXTERNAL == 2
    assert target["build_config"]["max_seq_len"] == MAX_SEQ_LEN + MAX_DRAFT_LEN
    assert draft["build_config"]["max_draft_len"] == 0
    assert draft["build_config"]["speculative_decoding_mode"] == SPEC_MODE_NONE == 1
    assert draft["build_config"]["max_seq_len"] == MAX_SEQ_LEN

    info = read_engine(built_fp8.target)
    assert info.backend == "torch" and info.accepts_draft_tokens and info.max_output_seq_len == MAX_SEQ_LEN
    info = read_engine(built_fp8.draft)
    assert not info.accepts_draft_tokens and info.max_output_seq_len == MAX_SEQ_LEN


def test_unquantized_engine_config(built_none):
    quant = json.loads((built_none.target / "config.json").read_text())["pretrained_config"]["quantization"]
    assert quant["quant_algo"] is None and quant["kv_cache_quant_algo"] is None
    weights = load_file(str(built_none.target / "rank0.safetensors"))
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert not any(k.endswith(fp8.SCALE_SUFFIX) for k in weights)


@pytest.mark.parametrize("role, per_channel", [("target", False), ("draft", True)])
def test_engine_weights_are_fp8_within_bound(built_fp8, tiny_pair, role, per_channel):
    weights_path = getattr(built_fp8, role) / "rank0.safetensors"
    with safe_open(str(weights_path), "pt") as f:
        assert f.metadata()["quantization"] == "fp8"
        assert f.metadata()["fp8_scaling"] == ("per_channel" if per_channel else "per_tensor")
    weights = load_file(str(weights_path))
    original = load_file(str(getattr(tiny_pair, role) / "model.safetensors"))
    quantized = [k for k, v in weights.items() if v.dtype == torch.float8_e4m3fn]
    expected = [k for k, v in original.items() if fp8.is_quantizable(k, v)]
    assert sorted(quantized) == sorted(expected) and len(quantized) == 7 * (2 if role == "target" else 1)
    for name in quantized:
        scale = weights[name.removesuffix(".weight") + ".weight_scale"]
        assert scale.dtype == torch.float32
        assert scale.shape == ((weights[name].shape[0], 1) if per_channel else ())
        check_fp8_error(original[name], weights[name], scale)
    for name, tensor in weights.items():  # everything else is kept exactly
        if tensor.dtype != torch.float8_e4m3fn and not name.endswith(".weight_scale"):
            assert torch.equal(tensor, original[name]), name


def test_engine_dir_has_tokenizer_and_manifest(built_fp8, tiny_pair):
    from transformers import AutoTokenizer

    for role in ("target", "draft"):
        engine = getattr(built_fp8, role)
        assert (engine / "tokenizer.json").is_file() and (engine / "tokenizer_config.json").is_file()
        # the checkpoint's end tokens travel with the engine, for the BLS (declared_end_ids)
        assert (engine / "generation_config.json").read_text() == (
            getattr(tiny_pair, role) / "generation_config.json"
        ).read_text()
        text = "The quick brown fox verifies drafts."
        assert (
            AutoTokenizer.from_pretrained(str(engine))(text).input_ids
            == AutoTokenizer.from_pretrained(str(getattr(tiny_pair, role)))(text).input_ids
        )

        manifest = read_manifest(engine)
        assert manifest["role"] == role and manifest["backend"] == "torch"
        sources = {Path(s["file"]).name: s for s in manifest["sources"]}
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(sources)
        for s in manifest["sources"]:
            assert s["sha256"] == sha256_file(Path(s["file"])) and s["bytes"] == Path(s["file"]).stat().st_size
        outputs = {o["file"]: o for o in manifest["outputs"]}
        assert {"config.json", "rank0.safetensors", "tokenizer.json"} <= set(outputs)
        for name, o in outputs.items():
            assert o["sha256"] == sha256_file(engine / name)
        assert set(manifest["durations_s"]) >= {"load checkpoint", "quantize fp8", "write engine"}
        assert all(isinstance(v, float) and v >= 0 for v in manifest["durations_s"].values())
        assert manifest["settings"]["model"]["quantization"] == "fp8"
    # each role's own key: the target's manifest never lists the draft's files
    assert all("draft" not in s["file"] for s in read_manifest(built_fp8.target)["sources"])


def test_cli_build_round_trip(built_fp8, tmp_path):
    """The CLI builds the same engines as `run_build`: config.json byte for byte, the same tensors (the
    weights file's bytes may differ: safetensors writes its metadata map in hash order)."""
    result = CliRunner().invoke(cli, ["build", "-c", str(built_fp8.config), "-o", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    assert "engines in" in result.output
    for role in ("target", "draft"):
        assert (tmp_path / "cli" / role / "config.json").read_bytes() == (
            built_fp8.engines / role / "config.json"
        ).read_bytes()
        new = load_file(str(tmp_path / "cli" / role / "rank0.safetensors"))
        old = load_file(str(built_fp8.engines / role / "rank0.safetensors"))
        assert set(new) == set(old)
        assert all(torch.equal(_bits(new[k]), _bits(old[k])) for k in new)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _console() -> Console:
    return Console(file=io.StringIO(), width=300)


# ---- skip, rebuild, dry run ---------------------------------------------------------------------------------


def _config(
    tmp_path: Path, pair, *, target_ckpt: Path | None = None, draft_ckpt: Path | None = None, **sections
) -> Path:
    sections = {"speculation": SPECULATION, "engine": ENGINE} | sections
    return write_config(tmp_path / "c.yaml", target_ckpt or pair.target, draft_ckpt or pair.draft, **sections)


def _state(engines: Path) -> dict:
    return {
        role: ((engines / role / "manifest.json").stat().st_mtime_ns, (engines / role / "manifest.json").read_text())
        for role in ("target", "draft")
    }


def test_unchanged_build_is_skipped_and_changes_rebuild(tiny_pair, tmp_path):
    config = _config(tmp_path, tiny_pair)
    out = run_build(config, tmp_path / "engines")
    first = _state(out)

    console = _console()
    assert run_build(config, out, console=console) == out
    assert console.file.getvalue().count("skip (up to date)") == 2
    assert _state(out) == first  # manifests untouched, same mtime
    result = CliRunner().invoke(cli, ["build", "-c", str(config), "-o", str(out)])  # the CLI skips too
    assert result.exit_code == 0, result.output
    assert _state(out) == first

    # A draft-only setting rebuilds the draft and leaves the target alone.
    config = _config(
        tmp_path,
        tiny_pair,
        draft={"checkpoint": str(tiny_pair.draft), "dtype": "float32", "fp8_scaling": "per_channel"},
    )
    run_build(config, out)
    second = _state(out)
    assert second["target"] == first["target"] and second["draft"] != first["draft"]
    assert "per_channel" in second["draft"][1]

    # An engine setting shared by both rebuilds both.
    config = _config(
        tmp_path,
        tiny_pair,
        draft={"checkpoint": str(tiny_pair.draft), "dtype": "float32", "fp8_scaling": "per_channel"},
        engine=ENGINE | {"max_seq_len": MAX_SEQ_LEN + 8},
    )
    run_build(config, out)
    third = _state(out)
    assert third["target"] != second["target"] and third["draft"] != second["draft"]
    assert read_engine(out / "target").max_seq_len == MAX_SEQ_LEN + 8 + MAX_DRAFT_LEN


def test_changed_checkpoint_or_damaged_output_rebuilds(tiny_pair, tmp_path):
    target = tmp_path / "target-copy"
    shutil.copytree(tiny_pair.target, target)
    config = _config(tmp_path, tiny_pair, target_ckpt=target)
    out = run_build(config, tmp_path / "engines")
    first = _state(out)

    generation = target / "generation_config.json"
    generation.write_text(generation.read_text() + "\n")  # same meaning, other bytes: a changed input
    run_build(config, out)
    second = _state(out)
    assert second["target"] != first["target"] and second["draft"] == first["draft"]

    weights = out / "draft" / "rank0.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")  # an output edited after the build
    run_build(config, out)
    assert _state(out)["draft"] != second["draft"]
    outputs = {o["file"]: o["sha256"] for o in read_manifest(out / "draft")["outputs"]}
    assert sha256_file(weights) == outputs["rank0.safetensors"]


def test_dry_run_writes_nothing(tiny_pair, tmp_path):
    config = _config(tmp_path, tiny_pair)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = CliRunner().invoke(cli, ["build", "-c", str(config), "-o", str(tmp_path / "engines"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "dry run: nothing written" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    console = _console()
    run_build(config, tmp_path / "engines", dry_run=True, console=console)
    text = console.file.getvalue()
    assert "target: " in text and "[float32, FP8 per tensor]" in text and "draft: " in text
    assert text.count(" build ") >= 2
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not (tmp_path / "engines").exists()


# ---- failures -----------------------------------------------------------------------------------------------


def _no_leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob("*") if ".partial-" in p.name]


@pytest.mark.parametrize("role", ["target", "draft"])
def test_corrupt_checkpoint_fails_cleanly(tiny_pair, tmp_path, role):
    broken = tmp_path / f"broken-{role}"
    shutil.copytree(getattr(tiny_pair, role), broken)
    (broken / "model.safetensors").write_bytes(b"this is not a safetensors file" * 100)
    config = _config(tmp_path, tiny_pair, **{f"{role}_ckpt": broken})
    out = tmp_path / "engines"
    with pytest.raises(CheckpointError, match="cannot load the weights of .*broken-"):
        run_build(config, out)
    assert not (out / role).exists()
    assert _no_leftovers(tmp_path) == []
    if role == "draft":  # each engine dir is replaced atomically: the finished target stays, complete
        assert read_manifest(out / "target") is not None
    else:
        assert not out.exists()

    result = CliRunner().invoke(cli, ["build", "-c", str(config), "-o", str(out)])
    assert result.exit_code == 2
    assert "error:" in result.output and "cannot load the weights" in result.output
    assert "Traceback" not in result.output


def test_failure_inside_the_write_leaves_no_partial_dir(tmp_path):
    final = tmp_path / "engine"
    final.mkdir()
    (final / "old.txt").write_text("previous build")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_dir(final) as scratch:
            (scratch / "config.json").write_text("{}")
            raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]
    assert (final / "old.txt").read_text() == "previous build"
    with atomic_dir(final) as scratch:
        (scratch / "config.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]
    assert [p.name for p in final.iterdir()] == ["config.json"]


def test_foreign_output_dir_is_refused_not_deleted(tiny_pair, tmp_path):
    out = tmp_path / "engines"
    (out / "target").mkdir(parents=True)
    precious = out / "target" / "precious.txt"
    precious.write_text("not an engine")
    with pytest.raises(TrtspecError, match="not an engine dir written by trtspec"):
        run_build(_config(tmp_path, tiny_pair), out)
    assert precious.read_text() == "not an engine"
    assert sorted(p.name for p in out.iterdir()) == ["target"]
    result = CliRunner().invoke(cli, ["build", "-c", str(_config(tmp_path, tiny_pair)), "-o", str(out), "--dry-run"])
    assert result.exit_code == 2 and "not an engine dir" in result.output
    assert precious.read_text() == "not an engine"


def test_config_errors_reach_the_cli_as_one_message(tiny_pair, tmp_path):
    config = _config(tmp_path, tiny_pair, speculation={"max_draft_len": 2, "num_draft_tokens": 3}, bogus=1)
    result = CliRunner().invoke(cli, ["build", "-c", str(config), "-o", str(tmp_path / "engines")])
    assert result.exit_code == 2
    assert "2 problems" in result.output
    assert "speculation.num_draft_tokens" in result.output and "bogus" in result.output
    assert not (tmp_path / "engines").exists()


def test_declared_end_ids_read_every_end_token(tmp_path):
    assert declared_end_ids(tmp_path, 7) == [7]  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128008, 128009]}))
    assert declared_end_ids(tmp_path, 128009) == [128009, 128001, 128008]  # the tokenizer's own first, no repeats
    assert declared_end_ids(tmp_path, None) == [128001, 128008, 128009]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert declared_end_ids(tmp_path, 0) == [0, 2]
    (tmp_path / "generation_config.json").write_text("not json")
    assert declared_end_ids(tmp_path, 0) == [0]


def test_e4m3_constants():
    # the values the bound above is derived from, read from torch's own E4M3 type
    info = torch.finfo(torch.float8_e4m3fn)
    assert info.max == 448.0 and info.tiny == 2.0**-6 and info.eps == 2.0**-3
    assert torch.tensor(2.0**-9).to(torch.float8_e4m3fn).float() == 2.0**-9  # the smallest subnormal
    assert math.isclose(float(torch.tensor(3 * 2.0**-11).to(torch.float8_e4m3fn).float()), 2.0**-9)


def test_a_gguf_loads_without_the_conversion_bar_or_the_float32_note(capsys):
    import logging

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from trtspec.checkpoint import _GGUF_DTYPE_NOTE, _quiet_gguf

    class Kept(logging.Handler):  # transformers' loggers do not propagate to the root, so pytest's caplog sees none
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    bar = gguf_utils.tqdm
    note = logging.getLogger("transformers.quantizers.quantizer_gguf")
    kept = Kept()
    note.addHandler(kept)
    try:
        with _quiet_gguf():
            for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
                pass
            note.warning(_GGUF_DTYPE_NOTE + " ... Pass `dtype=torch.float32` to avoid it")
            note.warning("a GGUF file with an unknown architecture")  # every other message still shows
    finally:
        note.removeHandler(kept)
    assert "Converting" not in capsys.readouterr().err
    assert kept.messages == ["a GGUF file with an unknown architecture"]
    assert gguf_utils.tqdm is bar and not note.filters  # as it was, after the load
