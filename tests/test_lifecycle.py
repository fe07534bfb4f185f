"""The draft's lifecycle on tiny models: distill from captured traffic starting from the deployed draft (--init-from),
and `trtspec shadow`'s figures against speculative decoding run for real on the same requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.tiny import make_checkpoint, make_perturbed_copy, write_config

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
    held = read_records(same / ".distill" / "heldout-captured.jsonl")  # what `trtspec shadow --data` compares on
    assert len(held) == 4 and all(r in read_records(captured) for r in held)

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


# ---- promote under load (a real tritonserver) ---------------------------------------------------------------------

PROMPTS = ["The quick brown fox", "Speculative decoding drafts tokens", "def add(a, b):", "Once upon a time there"]
SPEC = {"max_tokens": 16, "num_draft_tokens": 3, "speculation": "draft_model", "adaptive_draft_length": False}


@pytest.fixture(scope="module")
def promoted_server(tmp_path_factory):
    """The tiny pair served with every finished request captured (as `trtspec serve --capture DIR
    --capture-rate 1`): server.captures is the directory."""
    import compileall
    import os

    from support.tiny import served_pair

    from trtspec.capture import CAPTURE_ENV

    root = tmp_path_factory.mktemp("promote")
    server = served_pair(root / "pair")
    compileall.compile_dir(server.repo, quiet=1)  # as a repository served before (test_reliability.py)
    server.captures = root / "captures"
    before = os.environ.get(CAPTURE_ENV)
    os.environ[CAPTURE_ENV] = CaptureSettings(str(server.captures), rate=1.0).to_env()
    try:
        server.start(timeout=300)
    finally:
        os.environ.pop(CAPTURE_ENV) if before is None else os.environ.__setitem__(CAPTURE_ENV, before)
    yield server
    server.stop()


def _records(folder: Path, count: int, timeout: float = 120.0) -> list[dict]:
    """The captured records once there are at least `count` (the writer is a thread of its own)."""
    import time

    end = time.monotonic() + timeout
    while True:
        found = read_records(folder) if any(folder.glob("capture-*.jsonl")) else []
        if len(found) >= count or time.monotonic() > end:
            return found
        time.sleep(0.2)


@pytest.mark.server
def test_served_requests_are_captured_unless_the_client_says_store_false(promoted_server):
    from test_serving import grpc_generate, ids_of

    server = promoted_server
    responses = {}
    for prompt, store in (("The quick brown fox", None), ("def add(a, b):", False), ("Once upon a time", True)):
        fields = SPEC | {"text_input": prompt} | ({} if store is None else {"store": store})
        responses[prompt] = ids_of(grpc_generate(server.grpc_url, fields))
    kept = _records(server.captures, 2)
    assert len(kept) == 2
    by_prompt = {r["text_input"]: r for r in kept}
    assert set(by_prompt) == {"The quick brown fox", "Once upon a time"}  # never the one sent with store false
    for prompt, record in by_prompt.items():
        assert record["output_ids"] == responses[prompt]  # the target's output, as the client got it
        assert record["greedy"] and record["model"] == "tensorrt_llm_bls" and record["draft_version"] == "1"
        assert record["num_draft_tokens"] > 0


class _Traffic:
    """Speculative requests, one after another on each of `clients` threads, until stopped: every output kept."""

    def __init__(self, url: str, clients: int = 3):
        import threading

        self.url, self.stopped, self.errors, self.outputs = url, threading.Event(), [], []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]
        for thread in self.threads:
            thread.start()

    def _run(self, i: int) -> None:
        from test_serving import grpc_generate, ids_of

        sent = i
        while not self.stopped.is_set():
            prompt = PROMPTS[sent % len(PROMPTS)]
            try:
                self.outputs.append((prompt, ids_of(grpc_generate(self.url, SPEC | {"text_input": prompt}, 120))))
            except Exception as exc:  # noqa: BLE001 (kept for the assertion)
                self.errors.append(exc)
            sent += 1

    def stop(self) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(timeout=180)


def _wait_for_requests(traffic: _Traffic, more: int, timeout: float = 300.0) -> None:
    import time

    goal, end = len(traffic.outputs) + more, time.monotonic() + timeout
    while len(traffic.outputs) + len(traffic.errors) < goal and time.monotonic() < end:
        time.sleep(0.2)


def _labelled(metrics_url: str, label: str, timeout: float = 120.0) -> bool:
    """Whether the acceptance counter shows a series with `label` within `timeout` seconds."""
    import time
    import urllib.request

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with urllib.request.urlopen(metrics_url, timeout=30) as resp:
            lines = resp.read().decode().splitlines()
        if any(line.startswith("trtspec_accepted_tokens_total") and label in line for line in lines):
            return True
        time.sleep(0.5)
    return False


@pytest.mark.server
def test_promote_under_load_and_back(promoted_server, tmp_path):
    """A new draft loaded while requests run: none fails, greedy outputs stay the target's own, the acceptance
    metrics carry the draft's version; --previous brings version 1 back the same way."""

    from support.tiny import make_perturbed_copy
    from test_serving import grpc_generate, ids_of

    from trtspec import promote as P

    server = promoted_server
    repo = server.repo
    plain = {
        p: ids_of(grpc_generate(server.grpc_url, SPEC | {"text_input": p, "num_draft_tokens": 0})) for p in PROMPTS
    }
    target = Path(P.read_draft_model(repo).history["versions"]["1"]["checkpoint"]).parent / "target"
    new_draft = make_perturbed_copy(target, tmp_path / "draft-v2", noise=0.05, seed=7)
    headers = server.admin_headers | {"Content-Type": "application/json"}

    traffic = _Traffic(server.grpc_url)
    try:
        _wait_for_requests(traffic, 3)
        assert P.promote(repo, str(new_draft), url=server.http_url, headers=headers) == 2
        _wait_for_requests(traffic, 6)
        assert P.draft_version(repo) == "2"
        assert "versions: [ 2 ]" in (repo / P.DRAFT_MODEL / "config.pbtxt").read_text()
        # the BLS looks at the version once a second at most: requests that end later carry the new label
        labelled = _labelled(server.metrics_url, 'draft_version="2"')
        errors_at_promotion = list(traffic.errors)
        assert P.previous(repo, url=server.http_url, headers=headers) == 1
        _wait_for_requests(traffic, 6)
        assert P.draft_version(repo) == "1"
    finally:
        traffic.stop()
    assert not errors_at_promotion and not traffic.errors, traffic.errors[:3]
    assert len(traffic.outputs) >= 15
    assert labelled, "no trtspec_accepted_tokens_total series with the promoted draft's version"
    for prompt, ids in traffic.outputs:
        assert ids == plain[prompt], prompt
    # the capture says which draft each request ran with
    assert {"1", "2"} <= {r["draft_version"] for r in read_records(server.captures)}
    with pytest.raises(P.PromoteError, match="no promotion to go back from"):
        P.previous(repo, url=server.http_url, headers=headers)


def test_promote_refuses_a_tensorrt_llm_deployment(tmp_path):
    """TensorRT-LLM's engines run in a server of model-control mode none (as launch_triton_server.py starts rank 0):
    promote says so and builds or writes nothing."""
    from test_trtllm_deploy import deployed as deployed_70b  # the 70B example on engine dirs of NVIDIA's layout

    from trtspec import promote as P
    from trtspec.config import load_config
    from trtspec.deploy.writer import write_repository

    config, engines, repo = deployed_70b.__wrapped__(tmp_path)  # the fixture's function, called with our tmp_path
    write_repository(load_config(config), engines, repo)
    before = sorted(p.relative_to(repo) for p in repo.rglob("*"))
    with pytest.raises(P.PromoteError, match="model-control mode `none`.*rolling restart"):
        P.promote(repo, str(tmp_path / "new-draft"), url="127.0.0.1:1", headers={})
    with pytest.raises(P.PromoteError, match="mpirun"):
        P.previous(repo, url="127.0.0.1:1", headers={})
    assert sorted(p.relative_to(repo) for p in repo.rglob("*")) == before


def test_shadow_command_prints_both_drafts_and_a_verdict(target, deployed, captured):
    from click.testing import CliRunner

    from trtspec.cli import cli

    args = ["shadow", "--draft", str(deployed), "--against", str(target), "--data", str(captured)]
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["records"] == 40 and set(report["drafts"]) == {str(target), str(deployed)}
    assert set(report["drafts"][str(deployed)]) == {"(all)", "a", "b"}
    assert report["costs"]["source"].startswith("trtspec's default costs")
    # the target as its own draft accepts everything: the candidate (a distilled draft) does not beat it
    assert report["drafts"][str(target)]["(all)"]["by_k"][0]["acceptance"] == 1.0
    assert report["keep"] == str(target)
    table = CliRunner().invoke(cli, args, terminal_width=200)
    assert table.exit_code == 0 and "keep the deployed draft" in table.output
