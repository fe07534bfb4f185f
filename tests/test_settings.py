"""The BLS's settings (trtspec.serving_settings), its config.pbtxt template and what `trtspec deploy` writes agree:
one field per template parameter, and every parameter no build sets written at the field's default."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from trtspec.deploy import writer as repository
from trtspec.errors import TrtspecError
from trtspec.orchestrator.adaptive import CostModel
from trtspec.serving_settings import PER_BUILD, REQUIRED, ServingSettings

TEMPLATE = repository.TEMPLATES_DIR / repository.BLS_MODEL / repository.CONFIG_FILE
_PARAMETER = re.compile(r'^parameters: \{ key: "(\w+)" value: \{ string_value: "\$\{(\w+)\}" \} \}$', re.M)
FIELDS = dataclasses.fields(ServingSettings)


def template_parameters() -> dict[str, str]:
    """The template's parameters: key -> the template field that fills it."""
    text = TEMPLATE.read_text()
    found = dict(_PARAMETER.findall(text))
    assert len(found) == text.count("\nparameters:"), "a parameter line the pattern does not read"
    return found


def deployed_parameters(repo: Path) -> dict[str, str]:
    config = text_format.Parse(
        (repo / repository.BLS_MODEL / repository.CONFIG_FILE).read_text(), model_config_pb2.ModelConfig()
    )
    return {k: v.string_value for k, v in config.parameters.items()}


def test_every_template_parameter_is_a_setting_and_back():
    assert list(template_parameters()) == [f.name for f in FIELDS]


def test_deploy_writes_every_setting_no_build_sets_at_its_default(model_repository):
    written = deployed_parameters(model_repository)
    assert set(written) == {f.name for f in FIELDS}
    defaults = ServingSettings.written_defaults()
    assert set(defaults) == {f.name for f in FIELDS if not f.metadata.get(PER_BUILD)}
    for name, default in defaults.items():
        assert written[name] == repository._format(name, default), name
    settings = ServingSettings.from_parameters(written)
    for f in FIELDS:
        if not f.metadata.get(PER_BUILD):
            assert getattr(settings, f.name) == f.default, f.name


def test_the_template_values_hold_each_parameter_once(built_fp8):
    """The defaults and the build's values are disjoint, and together fill every parameter of the template."""
    from trtspec.config import load_config
    from trtspec.engine.manifest import read_engine

    config = load_config(built_fp8.config).config
    target, draft = read_engine(built_fp8.target), read_engine(built_fp8.draft)
    values = repository.template_values(config, target, draft, device="cpu")
    built = repository._bls_build_values(config, target, draft)
    assert not set(built) & set(ServingSettings.written_defaults())
    template = template_parameters()
    assert set(template.values()) <= set(values)
    assert {template[f.name] for f in FIELDS if f.metadata.get(PER_BUILD)} == set(built)


REQUIRED_PARAMETERS = {"tokenizer_dir": "/tokenizer", "max_input_len": "7", "max_seq_len": "9"}


def test_unset_parameters_read_as_the_defaults():
    assert REQUIRED_PARAMETERS.keys() == {f.name for f in FIELDS if f.metadata.get(REQUIRED)}
    unfilled = {key: "${" + field + "}" for key, field in template_parameters().items()}
    with pytest.raises(TrtspecError, match="model parameter 'tokenizer_dir' is not set"):
        ServingSettings.from_parameters(unfilled)
    expected = ServingSettings(
        tokenizer_dir="/tokenizer",
        max_input_len=7,
        max_seq_len=9,
        speculation_num_draft_tokens=4,
        default_speculation="none",
        max_input_chars=7 * 16,
    )
    for params in (unfilled, {key: "" for key in unfilled}, {}):
        assert ServingSettings.from_parameters(params | REQUIRED_PARAMETERS) == expected
    # the defaults that follow from other settings
    settings = ServingSettings.from_parameters(
        REQUIRED_PARAMETERS | {"default_num_draft_tokens": "3", "tensorrt_llm_draft_model_name": "d"}
    )
    assert (settings.speculation_num_draft_tokens, settings.default_speculation) == (3, "draft_model")
    assert ServingSettings.from_parameters(REQUIRED_PARAMETERS | {"max_input_chars": "50"}).max_input_chars == 50
    # the adaptive draft length starts from the same costs as a CostModel of its own
    costs = CostModel(settings.draft_cost_ratio, settings.verify_cost_per_token, settings.verify_cost_fixed)
    assert costs == CostModel()


@pytest.mark.parametrize(
    "params, error",
    [
        ({"draft_timeout_ms": "-1"}, "the parameter draft_timeout_ms must be >= 0 (0: no limit), got -1"),
        ({"governor_hold_seconds": "-2.5"}, "the parameter governor_hold_seconds must be >= 0, got -2.5"),
        (
            {"adaptive_draft_length": "maybe"},
            "model parameter 'adaptive_draft_length' = 'maybe' is not a boolean (true or false)",
        ),
        ({"max_queued_requests": "many"}, "invalid literal for int() with base 10: 'many'"),
        ({"request_timeout_ms": "-5"}, "the parameter request_timeout_ms must be >= 0 (0: no limit), got -5"),
        ({"max_stop_words": "-1"}, "the parameter max_stop_words must be >= 0 (0: none allowed), got -1"),
        ({"max_bad_words": "-1"}, "the parameter max_bad_words must be >= 0 (0: none allowed), got -1"),
        ({"max_returned_logits": "-1"}, "the parameter max_returned_logits must be >= 0 (0: none allowed), got -1"),
        ({"max_word_chars": "0"}, "the parameter max_word_chars must be >= 1, got 0"),
        ({"max_input_chars": "0"}, "the parameter max_input_chars must be >= 1, got 0"),
        ({"max_returned_logits": "1e6"}, "invalid literal for int() with base 10: '1e6'"),
    ],
)
def test_bad_values_are_refused(params, error):
    with pytest.raises((TrtspecError, ValueError)) as raised:
        ServingSettings.from_parameters(REQUIRED_PARAMETERS | params)
    assert str(raised.value) == error


def test_request_limits_have_bounded_defaults():
    """Every bound on what a request may ask is on by default, at the values docs/usage.md states."""
    settings = ServingSettings.from_parameters(REQUIRED_PARAMETERS | {"max_input_len": "4096"})
    assert settings.request_timeout_ms == 600_000
    assert (settings.max_stop_words, settings.max_bad_words, settings.max_word_chars) == (64, 64, 256)
    assert settings.max_input_chars == 16 * 4096
    assert settings.max_returned_logits == 2**24
    overridden = ServingSettings.from_parameters(
        REQUIRED_PARAMETERS
        | {"request_timeout_ms": "0", "max_stop_words": "2", "max_bad_words": "0", "max_returned_logits": "0"}
    )
    assert (overridden.request_timeout_ms, overridden.max_stop_words, overridden.max_bad_words) == (0, 2, 0)
    assert overridden.max_returned_logits == 0
