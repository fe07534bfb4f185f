"""`trtspec distill` on a tiny random target: the draft it writes, training, resume, build, and bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.tiny import make_checkpoint, write_config

from trtspec.checkpoint import SHARED_FILE, inspect_checkpoint, load_model
from trtspec.distill import DistillOptions, run_distill
from trtspec.distill.data import DistillError
from trtspec.distill.train import acceptance
from trtspec.engine.subset_head import SubsetHead

# Small enough to train in seconds: 24 prompts x 2 answers of <= 24 tokens; a head of 160 of the 320 tokens.
FAST = dict(
    prompts=24,
    samples=2,
    max_new_tokens=24,
    eval_prompts=8,
    eval_tokens=24,
    head_tokens=160,
    batch_tokens=512,
    lr=3e-3,
    threads=1,
)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    # A peaked random target (large init range): its next-token distributions carry something to learn.
    return make_checkpoint(tmp_path_factory.mktemp("distill") / "target", layers=3, seed=0, init_range=0.5)


@pytest.fixture(scope="module")
def distilled(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("distilled") / "draft"
    run_distill(DistillOptions(target=str(target), output=out, tokens=2400, eval_every=800, **FAST))
    return out


def _history(draft: Path) -> list[dict]:
    return json.loads((draft / "distill.json").read_text())["history"]


def test_draft_shares_tokenizer_and_embeddings(target, distilled):
    own = load_file(str(distilled / "model.safetensors"))
    assert "model.embed_tokens.weight" not in own and "lm_head.weight" not in own  # taken from the target
    assert "lm_head.token_ids" in own and own["lm_head.token_ids"].numel() == 160
    shared = json.loads((distilled / SHARED_FILE).read_text())
    assert Path(distilled / shared["target"]).resolve() == target.resolve()

    info, target_info = inspect_checkpoint(distilled), inspect_checkpoint(target)
    assert info.vocab == target_info.vocab and info.vocab_size == target_info.vocab_size
    draft_model = load_model(info, torch.float32)
    target_model = load_model(target_info, torch.float32)
    assert torch.equal(draft_model.model.embed_tokens.weight, target_model.model.embed_tokens.weight)
    head = draft_model.lm_head
    assert isinstance(head, SubsetHead)
    assert torch.equal(head.weight, target_model.lm_head.weight[head.token_ids])  # the target's rows
    assert draft_model.config.num_hidden_layers == 2


def test_training_lowers_the_kl(distilled):
    history = _history(distilled)
    assert [h["tokens"] for h in history][0] == 0  # the untrained draft is evaluated first
    assert history[-1]["tokens"] >= 2400
    assert history[-1]["kl"] < history[0]["kl"] * 0.95
    assert all(0.0 <= h["acceptance_k1"] <= 1.0 for h in history)


def test_resume_continues_from_the_checkpoint(target, distilled, tmp_path):
    out = tmp_path / "draft"
    shutil.copytree(distilled, out)
    shards = sorted((out / ".distill" / "data").rglob("shard-*.pt"))
    stamps = {p: p.stat().st_mtime_ns for p in shards}
    before = _history(out)
    run_distill(DistillOptions(target=str(target), output=out, tokens=4000, eval_every=800, resume=True, **FAST))
    after = _history(out)
    assert after[: len(before)] == before  # the earlier evaluations are kept, training went on from there
    assert after[-1]["tokens"] >= 4000 and after[-1]["steps"] > before[-1]["steps"]
    assert {p: p.stat().st_mtime_ns for p in shards} == stamps  # the target's answers were not generated again

    with pytest.raises(DistillError, match="other settings"):
        run_distill(
            DistillOptions(target=str(target), output=out, tokens=4000, resume=True, **(FAST | {"head_tokens": 100}))
        )
    with pytest.raises(DistillError, match="--resume"):
        run_distill(DistillOptions(target=str(target), output=out, tokens=4000, **FAST))


def test_the_draft_builds_and_speculates_exactly(target, distilled, tmp_path):
    from trtspec.compile import run_build
    from trtspec.contract import GenerationRequest, SamplingParams
    from trtspec.engine.runtime import Engine, InProcessClient
    from trtspec.orchestrator.drafters.draft_model import DraftModelDrafter
    from trtspec.orchestrator.loop import SpecRequest, speculate

    config = write_config(
        tmp_path / "build.yaml",
        target,
        distilled,
        speculation={"max_draft_len": 4, "num_draft_tokens": 3},
        engine={"max_input_len": 64, "max_seq_len": 128, "max_batch_size": 2},
    )
    engines = run_build(config, tmp_path / "engines")
    target_engine, draft_engine = Engine.load(engines / "target"), Engine.load(engines / "draft")
    prompt = [5, 17, 42, 9]
    # The draft engine answers in target ids, only ever from its head's tokens.
    drafted = draft_engine.generate(GenerationRequest(input_ids=prompt, request_output_len=6, end_id=-1)).new_tokens
    kept = set(draft_engine.model.head_ids.tolist())
    assert len(drafted) == 6 and set(drafted) <= kept
    plain = target_engine.generate(GenerationRequest(input_ids=prompt, request_output_len=20, end_id=-1)).new_tokens
    drafter = DraftModelDrafter(InProcessClient(draft_engine), sampling=SamplingParams(), end_id=None, pad_id=None)
    spec = [
        t
        for chunk in speculate(
            SpecRequest(prompt=prompt, max_tokens=20, num_draft_tokens=3), InProcessClient(target_engine), drafter
        )
        for t in chunk
    ]
    assert spec == plain
    assert target_engine.stats.num_draft_tokens > 0


def test_a_random_draft_with_the_whole_head(target, tmp_path):
    # --init random --head-tokens 0: the draft's head is the target's whole (tied) head, so it stores no head at all.
    out = tmp_path / "draft"
    run_distill(
        DistillOptions(
            target=str(target),
            output=out,
            tokens=600,
            eval_every=600,
            init="random",
            **(FAST | {"head_tokens": 0, "prompts": 8}),
        )
    )
    own = load_file(str(out / "model.safetensors"))
    assert not any(name.startswith(("lm_head", "model.embed_tokens")) for name in own)
    model, target_model = (
        load_model(inspect_checkpoint(out), torch.float32),
        load_model(inspect_checkpoint(target), torch.float32),
    )
    assert torch.equal(model.lm_head.weight, target_model.lm_head.weight)
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, target_model.model.layers[0].mlp.up_proj.weight)


def test_acceptance_replays_greedy_speculation():
    # K = 2 over [1, 1, 0, 1, 1, 1]: at 0, two drafts, both accepted, and the target adds position 2 itself;
    # at 3, two drafts (3 tokens left, minus the target's own), both accepted, and the target adds position 5.
    result = acceptance([[True, True, False, True, True, True]], 2)
    assert result["acceptance"] == pytest.approx(1.0) and result["tokens_per_call"] == pytest.approx(3.0)
    assert acceptance([[True, False, True, True]], 2)["acceptance"] == pytest.approx(2 / 3)  # 1 of 2, then 1 of 1
    assert acceptance([[False] * 5], 3)["acceptance"] == 0.0
    assert acceptance([[True] * 9], 1)["tokens_per_call"] == pytest.approx(9 / 5)


# ---- bad input: clear errors, nothing written ---------------------------------------------------------------------


def test_an_architecture_that_cannot_be_distilled(tmp_path):
    ckpt = tmp_path / "gpt2"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 320, "n_layer": 2})
    )
    (ckpt / "model.safetensors").write_bytes(b"")
    with pytest.raises(DistillError, match="GPT2LMHeadModel cannot be distilled"):
        run_distill(DistillOptions(target=str(ckpt), output=tmp_path / "out", **FAST))
    assert not (tmp_path / "out").exists()


def test_an_output_dir_that_holds_something_else(target, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(DistillError, match="not empty"):
        run_distill(DistillOptions(target=str(target), output=out, **FAST))
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    with pytest.raises(DistillError, match="no distillation to continue"):
        run_distill(DistillOptions(target=str(target), output=tmp_path / "new", resume=True, **FAST))


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("binary.txt", b"\x00\x01\x02\xff\xfe", "not UTF-8"),
        ("nul.txt", b"text\x00more", "NUL bytes"),
        ("empty.txt", b"  \n", "is empty"),
        ("bad.jsonl", b'{"prompt": "fine"}\n{"prompt": \n', "line 2: not valid JSON"),
        ("keys.jsonl", b'{"question": "what?"}\n', "line 1: expected an object"),
    ],
)
def test_data_that_does_not_tokenize(target, tmp_path, name, content, message):
    data = tmp_path / name
    data.write_bytes(content)
    out = tmp_path / "out"
    with pytest.raises(DistillError, match=message):
        run_distill(DistillOptions(target=str(target), output=out, data=[str(data)], **FAST))
    assert not out.exists()


def test_text_outside_the_vocabulary(target, tmp_path):
    # A tokenizer that is not the target's would give ids the target's embedding does not have.
    from trtspec.distill.data import Source, tokenize_source

    class Foreign:
        chat_template = None

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [1, 2, 10_000]}

    with pytest.raises(DistillError, match="outside the target's vocabulary"):
        tokenize_source(Source("x.txt", [], ["some text"], []), Foreign(), 320)


def test_the_draft_config_names_the_model_class():
    # A GGUF-loaded target's config has no `architectures`; the draft's must name the class the engine builds.
    from transformers import LlamaConfig

    from trtspec.distill.draft import draft_config

    target = LlamaConfig(
        num_hidden_layers=6, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=320
    )
    target.architectures = None
    config = draft_config(target, "LlamaForCausalLM", [0, 5], torch.arange(100))
    assert config.architectures == ["LlamaForCausalLM"] and config.num_hidden_layers == 2
    assert config.trtspec_head_tokens == 100 and config.tie_word_embeddings is False


def test_answers_are_the_targets_own_whatever_the_batch(target):
    """The engine's forward answers: greedy answers equal Hugging Face's greedy `generate`, with its raw logits,
    and neither greedy nor seeded sampled answers depend on how many rows decode together."""
    from trtspec.distill import compact_forward
    from trtspec.distill.data import decode_answers

    info = inspect_checkpoint(target)
    model = load_model(info, torch.float32).eval()
    compact = compact_forward(model, info.architecture, torch.device("cpu"))
    prompts = [[5, 17, 33], [9], [101, 7, 250, 3, 3, 8], [42, 42]]
    eos = 2
    one = decode_answers(
        compact, prompts, [0, 1, 2, 3], temperature=0.0, max_new_tokens=12, batch_size=1, top_k=8, seed=0, eos_id=eos
    )
    three = decode_answers(
        compact, prompts, [0, 1, 2, 3], temperature=0.0, max_new_tokens=12, batch_size=3, top_k=8, seed=0, eos_id=eos
    )
    for ids, a, b in zip(prompts, one, three):
        assert (
            torch.equal(a.ids, b.ids)
            and torch.equal(a.topk_ids, b.topk_ids)
            and torch.equal(a.topk_logits, b.topk_logits)
        )
        with torch.inference_mode():
            hf = model.generate(
                torch.tensor([ids]),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        answer = hf.sequences[0, len(ids) :].tolist()
        assert a.ids[a.first :].tolist() == answer
        top = torch.stack(hf.logits, dim=1)[0].topk(8, dim=-1)
        assert torch.equal(a.topk_ids[:, 0], top.indices[:, 0].to(torch.int32))
        torch.testing.assert_close(a.topk_logits.float(), top.values, atol=2e-2, rtol=1e-2)
    sampled = [
        decode_answers(
            compact,
            prompts,
            [0, 1, 2, 3],
            temperature=1.0,
            max_new_tokens=12,
            batch_size=bs,
            top_k=8,
            seed=3,
            eos_id=eos,
        )
        for bs in (1, 4)
    ]
    assert [s.ids.tolist() for s in sampled[0]] == [s.ids.tolist() for s in sampled[1]]
    assert [s.ids.tolist() for s in sampled[0]] != [s.ids.tolist() for s in one]  # sampling, not greedy


def test_padded_batches_answer_as_the_engine(target):
    """The transformers model in left-padded batches (the GPU's way) gives the engine's greedy answers and top-k
    logits, ends each row at its end token (kept), and seeded sampling repeats itself."""
    from trtspec.distill import compact_forward
    from trtspec.distill.data import decode_answers, decode_answers_padded

    info = inspect_checkpoint(target)
    model = load_model(info, torch.float32).eval()
    compact = compact_forward(model, info.architecture, torch.device("cpu"))
    prompts = [[5, 17, 33], [9], [101, 7, 250, 3, 3, 8], [42, 42], [7] * 11]
    numbers = list(range(len(prompts)))
    eos = 2
    engine = decode_answers(
        compact, prompts, numbers, temperature=0.0, max_new_tokens=12, batch_size=2, top_k=8, seed=0, eos_id=eos
    )
    padded = decode_answers_padded(
        model, prompts, numbers, temperature=0.0, max_new_tokens=12, batch_size=3, top_k=8, seed=0, eos_id=eos
    )
    for a, b in zip(engine, padded):
        assert a.first == b.first and torch.equal(a.ids, b.ids)
        assert torch.equal(a.topk_ids[:, 0], b.topk_ids[:, 0])
        torch.testing.assert_close(a.topk_logits.float(), b.topk_logits.float(), atol=2e-2, rtol=1e-2)
    ends = [s for s in padded if s.ids[-1] == eos]
    assert all(s.supervised <= 12 for s in padded) and all(eos not in s.ids[s.first : -1].tolist() for s in ends)
    sampled = [
        decode_answers_padded(
            model, prompts, numbers, temperature=1.0, max_new_tokens=12, batch_size=5, top_k=8, seed=3, eos_id=eos
        )
        for _ in range(2)
    ]
    assert [s.ids.tolist() for s in sampled[0]] == [s.ids.tolist() for s in sampled[1]]
    assert [s.ids.tolist() for s in sampled[0]] != [s.ids.tolist() for s in padded]


class _Planted:
    """Unpickling this creates `path`: a stand-in for any code a planted checkpoint could run."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_resume_refuses_a_checkpoint_that_would_run_code(target, distilled, tmp_path):
    """--resume reads its checkpoint as tensors and plain values only: a planted one (a shared output path, a work
    dir handed over) is refused with an error naming it, and nothing in it runs."""
    out = tmp_path / "draft"
    shutil.copytree(distilled, out)
    checkpoint = out / ".distill" / "checkpoint.pt"
    saved = torch.load(checkpoint, weights_only=True)  # what distill writes loads this way
    assert {"model", "optimizer", "run", "torch_rng"} <= saved.keys()

    proof = tmp_path / "proof"  # the plant is real: full unpickling runs it
    torch.save({"x": _Planted(proof)}, tmp_path / "plant.pt")
    torch.load(tmp_path / "plant.pt", weights_only=False)
    assert proof.exists()

    ran = tmp_path / "ran"
    torch.save(saved | {"run": saved["run"] | {"note": _Planted(ran)}}, checkpoint)
    with pytest.raises(DistillError, match="not written by `trtspec distill`") as err:
        run_distill(DistillOptions(target=str(target), output=out, tokens=4000, eval_every=800, resume=True, **FAST))
    assert str(checkpoint) in str(err.value)
    assert not ran.exists()
