"""The draft's lifecycle on tiny models: distill from captured traffic starting from the deployed draft (--init-from),
and `trtspec shadow`'s figures against speculative decoding run for real on the same requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import make_checkpoint, make_perturbed_copy, write_config

from trtspec.capture import Capture, CaptureSettings, make_record, read_records
from trtspec.distill import DistillOptions, run_distill
from trtspec.distill.data import DistillError

FAST = dict(
    prompts=16,
    samples=1,
    max_new_tokens=16,
    eval_prompts=8,
    eval_tokens=16,
    head_tokens=160,
    batch_tokens=512,
    lr=3e-3,
    threads=1,
)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("lifecycle") / "target", layers=3, seed=0, init_range=0.5)


@pytest.fixture(scope="module")
def deployed(target, tmp_path_factory) -> Path:
    """The deployed draft: distilled from the target's answers to the built-in prompts."""
    out = tmp_path_factory.mktemp("deployed") / "draft"
    run_distill(DistillOptions(target=str(target), output=out, tokens=800, eval_every=800, **FAST))
    return out


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=-1)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def captured(target, tmp_path_factory) -> Path:
    """Requests captured as `trtspec serve --capture` writes them: the target's greedy answers, two routes."""
    from trtspec.checkpoint import inspect_checkpoint, load_model

    model = load_model(inspect_checkpoint(target), torch.float32)
    folder = tmp_path_factory.mktemp("capture")
    capture = Capture(CaptureSettings(str(folder), rate=1.0), seed=0)
    gen = torch.Generator().manual_seed(3)
    for i in range(40):
        prompt = torch.randint(2, 320, (6 + i % 5,), generator=gen).tolist()
        answer = _greedy(model, prompt, 20)
        record = make_record(
            model="tensorrt_llm_bls",
            route="a" if i % 2 else "b",
            input_ids=prompt,
            output_ids=answer,
            text_input="",
            text_output="",
            temperature=0.0,
            num_draft_tokens=0,
            num_accepted_tokens=0,
        )
        capture.offer(record)
    capture.close()
    assert len(read_records(folder)) == 40
    return folder


def test_distill_from_a_capture_starts_from_the_deployed_draft(target, deployed, captured, tmp_path):
    # no training: the written draft is the deployed one, tensor for tensor
    same = tmp_path / "same"
    run_distill(
        DistillOptions(target=str(target), output=same, data=[str(captured)], init_from=str(deployed), tokens=0, **FAST)
    )
    before, after = load_file(str(deployed / "model.safetensors")), load_file(str(same / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    recipe = json.loads((same / "distill.json").read_text())
    assert recipe["init_from"] == str(deployed)
    # the evaluation set is the held-out captured requests (10% of 40), not the built-in prompts
    assert recipe["heldout"]["prompts"] == 4 and recipe["heldout"]["tokens"] == 4 * 20
    assert recipe["data"][str(captured)]["sequences"] == 36

    # trained on the capture, from there: the evaluation on held-out traffic starts at the deployed draft's figure
    out = tmp_path / "new"
    run_distill(
        DistillOptions(
            target=str(target),
            output=out,
            data=[str(captured)],
            init_from=str(deployed),
            tokens=3000,
            eval_every=1500,
            **FAST,
        )
    )
    history = json.loads((out / "distill.json").read_text())["history"]
    start = json.loads((same / "distill.json").read_text())["history"][0]
    assert history[0]["kl"] == start["kl"] and history[0]["acceptance_k1"] == start["acceptance_k1"]
    assert history[-1]["kl"] < history[0]["kl"]


def test_init_from_must_be_a_distilled_draft_of_this_target(target, deployed, captured, tmp_path):
    other = make_checkpoint(tmp_path / "other", layers=3, seed=5, init_range=0.5)
    with pytest.raises(DistillError, match="not a draft written by `trtspec distill`"):
        run_distill(DistillOptions(target=str(target), output=tmp_path / "a", init_from=str(other), **FAST))
    with pytest.raises(DistillError, match="was distilled for the target"):
        run_distill(DistillOptions(target=str(other), output=tmp_path / "b", init_from=str(deployed), **FAST))


def test_shadow_agrees_with_speculative_decoding_run_for_real(target, captured, tmp_path):
    """The teacher-forced replay's drafted and accepted tokens at each K are those the orchestrator counts when it
    speculates the same requests with the same draft on the engines (unquantized, so the numbers are the same)."""
    from trtspec.compile import run_build
    from trtspec.contract import SamplingParams
    from trtspec.engine.runtime import Engine, InProcessClient
    from trtspec.orchestrator.adaptive import FixedDraftLength
    from trtspec.orchestrator.drafters.draft_model import DraftModelDrafter
    from trtspec.orchestrator.loop import SpecRequest, speculate
    from trtspec.orchestrator.stats import RequestStats
    from trtspec.shadow import OVERALL, run_shadow

    draft = make_perturbed_copy(target, tmp_path / "draft", noise=0.1, seed=1)
    config = write_config(
        tmp_path / "build.yaml",
        target,
        draft,
        target={"quantization": "none", "kv_cache_dtype": "auto"},
        draft={"quantization": "none", "kv_cache_dtype": "auto"},
        speculation={"max_draft_len": 6, "num_draft_tokens": 2},
        engine={"max_input_len": 64, "max_seq_len": 128, "max_batch_size": 2},
    )
    engines = run_build(config, tmp_path / "engines")
    target_engine, draft_engine = Engine.load(engines / "target"), Engine.load(engines / "draft")
    records = read_records(captured)

    report = run_shadow(str(draft), str(draft), [str(captured)])
    assert report.records == 40 and report.left_out == 0
    shadow = {r["k"]: r for r in report.drafts[1].by_route[OVERALL]}
    assert 0.2 < shadow[1]["acceptance"] < 0.98, shadow[1]  # a draft that agrees often, not always
    for k in (1, 3, 6):
        stats = RequestStats()
        for record in records:
            drafter = DraftModelDrafter(
                InProcessClient(draft_engine), sampling=SamplingParams(), end_id=None, pad_id=None
            )
            out = [
                t
                for chunk in speculate(
                    SpecRequest(prompt=record["input_ids"], max_tokens=len(record["output_ids"]), num_draft_tokens=k),
                    InProcessClient(target_engine),
                    drafter,
                    policy=FixedDraftLength(k),
                    stats=stats,
                )
                for t in chunk
            ]
            assert out == record["output_ids"]  # the capture is the target's greedy output
        assert stats.num_draft_tokens > 0
        assert shadow[k]["acceptance"] == pytest.approx(stats.num_accepted_tokens / stats.num_draft_tokens, abs=1e-9)
    assert set(report.drafts[0].by_route) == {OVERALL, "a", "b"}
    assert report.keep == str(draft)  # equal drafts: the deployed one stays
