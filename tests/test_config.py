"""The build-config loader: schema errors with their fields, all problems at once, and the checks the schema
cannot see (checkpoints exist, run on the embedded engine, and share the target's vocabulary)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from support.tiny import make_checkpoint

from trtspec.config import LoadedConfig, load_config
from trtspec.errors import ConfigError

OTHER_CORPUS = [
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt.",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
    "SELECT name, count(*) FROM users GROUP BY name HAVING count(*) > 1;",
]


def write(path: Path, config: dict | str) -> Path:
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def base(pair, **top) -> dict:
    config = {
        "name": "tiny",
        "backend": "torch",
        "target": {"checkpoint": str(pair.target), "dtype": "float32"},
        "draft": {"checkpoint": str(pair.draft), "dtype": "float32"},
    }
    return config | top


def problems_of(path: Path) -> dict[str, object]:
    """field -> Problem, from the one ConfigError that loading raises."""
    with pytest.raises(ConfigError) as info:
        load_config(path)
    problems = info.value.problems
    fields = [p.field for p in problems]
    assert len(fields) == len(set(fields)), f"a field is reported twice: {fields}"
    for p in problems:  # every problem is in the message the user sees
        assert p.field in str(info.value)
    return {p.field: p for p in problems}


def test_valid_config_loads(tiny_pair, tmp_path):
    loaded = load_config(write(tmp_path / "ok.yaml", base(tiny_pair)))
    assert isinstance(loaded, LoadedConfig)
    assert [role for role, _, _ in loaded.models()] == ["target", "draft"]
    assert loaded.checkpoints["target"].architecture == "LlamaForCausalLM"
    assert loaded.checkpoints["draft"].architecture == "Qwen2ForCausalLM"
    assert loaded.config.speculation.max_draft_len == 8  # defaults filled in


def test_every_schema_error_is_reported_with_its_field_at_once(tiny_pair, tmp_path):
    config = base(
        tiny_pair,
        name="bad name!",
        backend="tensorrt",
        speculation={"max_draft_len": 4, "num_draft_tokens": 5},
        engine={"max_input_len": 128, "max_seq_len": 128},
    )
    config["target"]["dtyp"] = "float32"  # unknown key (misspelt)
    config["draft"]["quantization"] = "int4"  # bad literal inside the optional section
    found = problems_of(write(tmp_path / "bad.yaml", config))
    assert set(found) == {
        "target.dtyp",
        "draft.quantization",
        "name",
        "backend",
        "speculation.num_draft_tokens",
        "engine.max_seq_len",
    }
    assert found["target.dtyp"].value == "float32"
    assert "remove it or correct its spelling" in found["target.dtyp"].fix
    assert found["draft.quantization"].value == "int4"
    assert "'fp8'" in found["draft.quantization"].message
    assert found["backend"].value == "tensorrt"
    assert found["name"].value == "bad name!"
    assert "max_draft_len (4)" in found["speculation.num_draft_tokens"].message
    assert found["speculation.num_draft_tokens"].value == 5
    assert "max_input_len (128)" in found["engine.max_seq_len"].message


def test_missing_target_is_reported_with_the_other_problems(tmp_path):
    found = problems_of(write(tmp_path / "c.yaml", {"name": "ok", "engine": {"max_batch_size": 0}}))
    assert set(found) == {"target", "engine.max_batch_size"}
    assert found["target"].fix == "add it"


def test_draft_limits_use_schema_defaults(tiny_pair, tmp_path):
    # num_draft_tokens alone above the default max_draft_len (8); max_input_len alone above the default max_seq_len
    found = problems_of(
        write(tmp_path / "c.yaml", base(tiny_pair, speculation={"num_draft_tokens": 9}, engine={"max_input_len": 4096}))
    )
    assert set(found) == {"speculation.num_draft_tokens", "engine.max_seq_len"}


def test_non_numbers_are_left_to_the_schema(tiny_pair, tmp_path):
    found = problems_of(write(tmp_path / "c.yaml", base(tiny_pair, speculation={"num_draft_tokens": "four"})))
    assert set(found) == {"speculation.num_draft_tokens"}
    assert "integer" in found["speculation.num_draft_tokens"].message


def test_parallelism_on_the_embedded_backend_is_refused(tiny_pair, tmp_path):
    config = base(tiny_pair)
    config["target"]["tp_size"] = 2
    config["draft"]["pp_size"] = 2
    found = problems_of(write(tmp_path / "c.yaml", config))
    assert set(found) == {"target.tp_size", "draft.pp_size"}
    assert "backend: trtllm" in found["target.tp_size"].fix
    # The same parallelism is a valid trtllm config.
    loaded = load_config(write(tmp_path / "trt.yaml", config | {"backend": "trtllm"}))
    assert loaded.config.target.tp_size == 2


def test_context_logits_are_refused_on_the_trtllm_backend(tiny_pair, tmp_path):
    config = base(tiny_pair, engine={"gather_context_logits": True, "gather_generation_logits": True})
    assert load_config(write(tmp_path / "torch.yaml", config)).config.gathers_context_logits("target")
    found = problems_of(write(tmp_path / "trt.yaml", config | {"backend": "trtllm"}))
    assert (
        set(found) == {"engine.gather_context_logits"}
        and "max_draft_len" in found["engine.gather_context_logits"].message
    )


def test_missing_checkpoint_is_reported(tiny_pair, tmp_path):
    config = base(tiny_pair)
    config["draft"]["checkpoint"] = str(tmp_path / "nowhere")
    found = problems_of(write(tmp_path / "c.yaml", config))
    assert set(found) == {"draft.checkpoint"}
    assert "does not exist" in found["draft.checkpoint"].message


def test_relative_checkpoints_resolve_against_the_config_folder(tiny_pair, tmp_path, monkeypatch):
    folder = tiny_pair.root / "configs" / "nested"
    folder.mkdir(parents=True)
    config = base(tiny_pair)
    config["target"]["checkpoint"] = "../../target"
    config["draft"]["checkpoint"] = "../../draft"
    path = write(folder / "rel.yaml", config)
    monkeypatch.chdir(tmp_path)  # the working dir must not matter
    loaded = load_config(path)
    assert loaded.checkpoints["target"].path == tiny_pair.target.resolve()
    assert loaded.checkpoints["draft"].path == tiny_pair.draft.resolve()
    # ...and a config given by a relative path resolves the same way
    monkeypatch.chdir(tiny_pair.root)
    assert load_config("configs/nested/rel.yaml").checkpoints["target"].path == tiny_pair.target.resolve()


def test_draft_with_another_tokenizer_is_refused(tiny_pair, tmp_path):
    other = make_checkpoint(tmp_path / "other-draft", layers=1, seed=2, corpus=OTHER_CORPUS)
    config = base(tiny_pair)
    config["draft"]["checkpoint"] = str(other)
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path / "c.yaml", config))
    (problem,) = info.value.problems
    assert problem.field == "draft.checkpoint"
    assert problem.value == str(other)
    assert "tokenizer maps tokens to other ids" in problem.message
    assert str(other) in str(info.value)  # the message names the draft


@pytest.mark.parametrize("use_draft_logits", [False, True])
def test_draft_with_a_smaller_vocabulary_is_refused(tiny_pair, tmp_path, use_draft_logits):
    small = make_checkpoint(tmp_path / "small-draft", layers=1, seed=2, vocab_size=300)
    config = base(tiny_pair, speculation={"use_draft_logits": use_draft_logits})
    config["draft"]["checkpoint"] = str(small)
    found = problems_of(write(tmp_path / "c.yaml", config))
    assert set(found) == {"draft.checkpoint"}
    assert "300 of 300 differ" not in found["draft.checkpoint"].message  # the ids it has agree; it lacks tokens
    assert str(small) in str(found["draft.checkpoint"])


def test_same_tokens_with_padded_vocab_size_needs_token_matching(tiny_pair, tmp_path):
    padded = make_checkpoint(tmp_path / "padded-draft", layers=1, seed=2, model_vocab_size=384)
    config = base(tiny_pair)
    config["draft"]["checkpoint"] = str(padded)
    loaded = load_config(write(tmp_path / "match.yaml", config))
    assert loaded.checkpoints["draft"].vocab_size == 384
    assert loaded.checkpoints["draft"].vocab == loaded.checkpoints["target"].vocab

    config["speculation"] = {"use_draft_logits": True}
    found = problems_of(write(tmp_path / "logits.yaml", config))
    assert set(found) == {"draft.checkpoint"}
    assert "draft vocab_size 384 differs from the target's 320" in found["draft.checkpoint"].message
    assert "use_draft_logits: false" in found["draft.checkpoint"].fix


def test_unsupported_architecture_is_refused(tiny_pair, tmp_path):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 320})
    )
    save_file({"wte.weight": torch.zeros(320, 8)}, str(gpt2 / "model.safetensors"))
    config = base(tiny_pair)
    config["target"]["checkpoint"] = str(gpt2)
    del config["draft"]
    found = problems_of(write(tmp_path / "c.yaml", config))
    assert set(found) == {"target.checkpoint"}
    assert "GPT2LMHeadModel is not supported" in found["target.checkpoint"].message
    assert "LlamaForCausalLM" in found["target.checkpoint"].fix


def test_checkpoint_without_safetensors_is_refused(tiny_pair, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tiny_pair.target / "config.json").read_text())
    config = base(tiny_pair)
    config["target"]["checkpoint"] = str(bare)
    found = problems_of(write(tmp_path / "c.yaml", config))
    assert set(found) == {"target.checkpoint"}
    assert "safetensors" in found["target.checkpoint"].message


def test_yaml_is_read_with_safe_load(tmp_path):
    marker = tmp_path / "executed"
    path = write(tmp_path / "evil.yaml", f'name: !!python/object/apply:os.system ["touch {marker}"]\n')
    found = problems_of(path)
    assert set(found) == {"config"}
    assert "not valid YAML" in found["config"].message
    assert not marker.exists()
    found = problems_of(write(tmp_path / "obj.yaml", "name: !!python/object:collections.OrderedDict {}\n"))
    assert set(found) == {"config"}


def test_real_yaml_syntax_is_read(tiny_pair, tmp_path):
    text = f"""
# a comment
name: tiny-yaml
target:
  checkpoint: {tiny_pair.target}
  dtype: float32
speculation: {{max_draft_len: 2, num_draft_tokens: 2}}
"""
    loaded = load_config(write(tmp_path / "c.yaml", text))
    assert loaded.config.name == "tiny-yaml" and loaded.config.draft is None
    assert loaded.config.speculation.max_draft_len == 2


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", ""])
def test_a_config_must_be_a_mapping(tmp_path, text):
    assert set(problems_of(write(tmp_path / "c.yaml", text))) == {"config"}


def test_missing_config_file(tmp_path):
    assert set(problems_of(tmp_path / "absent.yaml")) == {"config"}


def test_quantize_lm_head_needs_fp8_weights(tiny_pair, tmp_path):
    config = base(tiny_pair)
    config["target"].update(quantization="none", quantize_lm_head=True)
    config["draft"].update(quantize_lm_head=True)  # FP8 by default: allowed
    found = problems_of(write(tmp_path / "head.yaml", config))
    assert set(found) == {"target.quantize_lm_head"}
    assert "set quantization: fp8" in found["target.quantize_lm_head"].fix
