"""`trtspec distill`: train a draft for a target, on what the target itself says.

Steps (each one's output is kept under `<output>/.distill/`, so a re-run with `--resume` skips what is done):
  1. check everything that can be checked before any work: the target's architecture, the output dir, every
     `--data` source (readable, tokenizes into the target's vocabulary);
  2. the target answers the prompt sets (greedy, plus sampled answers for variety) and reads the given texts and
     captured requests; its top-k logits at every answer position are stored with the tokens (`data.py`);
  3. the draft: a few decoder layers of the target's architecture on the target's embeddings and head, the head
     restricted to the tokens the target emits most (`draft.py`); or, with `--init-from`, a draft this command
     wrote before (the deployed one), trained further on new data instead of starting over;
  4. KL training with evaluation every `eval_every` tokens: greedy acceptance on the target's answers to held-out
     prompts, or on held-out captured requests when the data has any (`train.py`); each evaluation checkpoints the
     run and rewrites the draft in `<output>`.
The result is a Hugging Face checkpoint holding only the draft's own weights; `trtspec build` assembles it with the
target's (see `trtspec.checkpoint`).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import time
import types
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from trtspec import __version__, capture
from trtspec.checkpoint import (
    PACKAGE_SCHEME,
    SHARED_FILE,
    inspect_checkpoint,
    load_model,
    load_tokenizer,
    resolve_checkpoint_path,
)
from trtspec.distill import data as D
from trtspec.distill import draft as M
from trtspec.distill import train as T
from trtspec.distill.data import DistillError

WORK_DIR = ".distill"
STATE_FILE = "state.json"
CHECKPOINT_FILE = "checkpoint.pt"
HELDOUT = "builtin:assistant-heldout"
HELDOUT_CAPTURED = "heldout-captured.jsonl"  # in WORK_DIR: the held-out captured requests
INIT_CHOICES = ("from-target", "random")
QUANT_CHOICES = ("none", "fp8", "fp8-per-channel")

# Options that define what is trained; a --resume must keep them (the others may change between runs).
DEFINING = (
    "target",
    "layers",
    "init",
    "data",
    "seed",
    "head_tokens",
    "prompts",
    "samples",
    "temperature",
    "max_new_tokens",
    "top_k",
    "target_quantization",
    "eval_prompts",
    "eval_tokens",
    "answers_by",
    "init_from",
)
# Who decodes the target's answers: the embedded engine's compact forward (what the deployment runs; one attention
# call per row, fine on a CPU), or the transformers model on the same rounded weights in padded batches (a GPU's
# way: a few hundred launches a step whatever the batch). auto: the engine on a CPU, transformers on CUDA.
ANSWERS_BY = ("auto", "engine", "transformers")


@dataclass
class DistillOptions:
    target: str
    output: Path
    layers: int = 2
    init: str = "from-target"
    data: list[str] = field(default_factory=lambda: ["builtin:assistant"])
    tokens: int = 300_000  # supervised tokens to train on (several passes over the data if needed)
    seed: int = 0
    resume: bool = False
    head_tokens: int = 8192  # rows of the draft's head (the most frequent target tokens); 0: all
    prompts: int | None = None  # at most this many prompts of each prompt source
    samples: int = 2  # answers per prompt: one greedy, the others sampled at `temperature`
    temperature: float = 0.8
    max_new_tokens: int = 192
    top_k: int = 32  # target logits kept per position
    target_quantization: str = "none"  # round the teacher's weights as the engine will (FP8)
    eval_prompts: int = 32
    eval_tokens: int = 128
    eval_every: int = 25_000
    batch_tokens: int = 4096
    lr: float = 5e-4
    generate_batch: int = 32
    device: str = "auto"
    threads: int | None = None
    answers_by: str = "auto"
    init_from: str | None = None  # a draft written by `trtspec distill` (the deployed one) to start from
    heldout_share: float = 0.1  # of captured requests, held out as the evaluation set
    window: int = 1024  # tokens of a captured request learned from (the prompt's start is cut first)

    def defining(self) -> dict:
        values = asdict(self)
        return {k: values[k] for k in DEFINING}


# ---- checks -----------------------------------------------------------------------------------------------------


def check_options(o: DistillOptions) -> None:
    if o.init not in INIT_CHOICES:
        raise DistillError(f"--init {o.init!r}: choose one of {', '.join(INIT_CHOICES)}")
    if o.answers_by not in ANSWERS_BY:
        raise DistillError(f"--answers-by {o.answers_by!r}: choose one of {', '.join(ANSWERS_BY)}")
    if o.target_quantization not in QUANT_CHOICES:
        raise DistillError(f"--target-quantization {o.target_quantization!r}: choose one of {', '.join(QUANT_CHOICES)}")
    for name in (
        "tokens",
        "eval_prompts",
        "eval_every",
        "batch_tokens",
        "generate_batch",
        "max_new_tokens",
        "top_k",
        "samples",
    ):
        if getattr(o, name) < (0 if name == "tokens" else 1):
            raise DistillError(f"--{name.replace('_', '-')} must be positive, got {getattr(o, name)}")
    if not o.data:
        raise DistillError("no --data: give at least one prompt set or text file")
    if not 0.0 < o.heldout_share < 1.0:
        raise DistillError(f"--heldout-share must lie strictly between 0 and 1, got {o.heldout_share}")
    if HELDOUT in o.data:
        raise DistillError(f"--data {HELDOUT} is the held-out evaluation set; train on other data")


def check_output(output: Path, resume: bool) -> None:
    """The output dir must be new or empty, or hold this command's own earlier run (continued with --resume)."""
    if output.exists() and not output.is_dir():
        raise DistillError(f"--output {output} is a file; give a directory")
    entries = sorted(p.name for p in output.iterdir()) if output.is_dir() else []
    if (output / WORK_DIR / STATE_FILE).is_file():
        if not resume:
            raise DistillError(
                f"--output {output} holds an earlier distillation; pass --resume to continue it, "
                "or choose another --output"
            )
        return
    if resume:
        raise DistillError(
            f"--resume: {output} holds no distillation to continue ({output / WORK_DIR / STATE_FILE} is missing)"
        )
    if entries:
        what = (
            "a draft without its work state (.distill/)"
            if SHARED_FILE in entries
            else f"other files ({', '.join(entries[:4])}{', ...' if len(entries) > 4 else ''})"
        )
        raise DistillError(
            f"--output {output} is not empty: it holds {what}; nothing was changed. Choose a new or empty directory"
        )


def _target_spec_for(output: Path, spec: str, path: Path) -> str:
    """How the draft names its target: `pkg:` as given, else a path relative to the draft when possible."""
    if spec.startswith(PACKAGE_SCHEME):
        return spec
    try:
        return os.path.relpath(path, output)
    except ValueError:  # another drive
        return str(path)


# ---- the run ----------------------------------------------------------------------------------------------------


def run_distill(o: DistillOptions, console: Console | None = None) -> Path:
    console = console or Console(stderr=True)
    check_options(o)
    output = Path(o.output).expanduser().resolve()
    check_output(output, o.resume)
    if o.threads:
        torch.set_num_threads(o.threads)
    device = torch.device(
        "cuda" if o.device == "auto" and torch.cuda.is_available() else ("cpu" if o.device == "auto" else o.device)
    )
    if o.answers_by == "auto":  # recorded as resolved, so that the recipe names who decoded the answers
        o = replace(o, answers_by="transformers" if device.type == "cuda" else "engine")

    # 1. everything that can fail on the user's input, before anything is written
    target_path = resolve_checkpoint_path(o.target, Path.cwd())
    info = inspect_checkpoint(target_path)
    M.check_distillable(info, types.SimpleNamespace(**info.config))
    layers = M.default_layers(int(info.config["num_hidden_layers"]), o.layers)
    sources = [D.read_source(spec, limit=o.prompts, seed=o.seed) for spec in o.data]
    tokenizer = load_tokenizer(info)
    tokenized = [D.tokenize_source(src, tokenizer, info.vocab_size) for src in sources]
    # captured requests: a seeded share of each capture source is the evaluation set (the traffic itself)
    captured, captured_heldout, held_records = [], [], []
    for src in sources:
        train, held = capture.split_heldout(src.captured, o.heldout_share, at_most=o.eval_prompts, seed=o.seed)
        src.captured, held_records = train, held_records + held
        captured.append(D.captured_pairs(src, info.vocab_size, o.window))
        captured_heldout += D.captured_pairs(replace(src, captured=held), info.vocab_size, o.window)
    heldout = []
    if not captured_heldout:
        heldout, _ = D.tokenize_source(D.read_source(HELDOUT, limit=o.eval_prompts), tokenizer, info.vocab_size)
    eos = tokenizer.eos_token_id
    start = _initial_draft(o.init_from, info, fingerprint=_fingerprint(info)) if o.init_from else None
    if start is not None:
        layers = start.layers

    work = output / WORK_DIR
    work.mkdir(parents=True, exist_ok=True)
    _check_state(work, o)
    if held_records:  # for `trtspec shadow --data`: the requests neither draft was trained on (user data: 0600)
        capture.write_records(work / HELDOUT_CAPTURED, held_records)
    console.print(
        f"target {escape(str(info.path))} ({info.architecture}, {info.config['num_hidden_layers']} layers); "
        f"draft: {len(layers)} layers from target layers {layers} "
        f"({escape('from ' + o.init_from) if o.init_from else o.init}); device {device}, "
        f"{torch.get_num_threads()} threads",
        highlight=False,
    )

    # 2. the target's outputs
    fingerprint = _fingerprint(info)
    with _progress(console) as progress:
        step = progress.add_task("loading the target", total=None)
        target = load_model(info, torch.float32)
        round_like_engine(target, o.target_quantization)
        target.to(device)
        answerer = compact_forward(target, info.architecture, device) if o.answers_by == "engine" else target
        progress.update(step, description="target loaded", total=1, completed=1)
        train_seqs, stats = [], {}
        for src, (prompt_ids, text_ids), pairs in zip(sources, tokenized, captured):
            seqs = []
            for sample in range(o.samples if prompt_ids else 0):
                temperature = 0.0 if sample == 0 else o.temperature
                seqs += _answers(
                    answerer,
                    prompt_ids,
                    work,
                    fingerprint,
                    o,
                    temperature,
                    o.seed + sample,
                    o.max_new_tokens,
                    eos,
                    progress,
                    f"{src.spec}: answers {sample + 1}/{o.samples}",
                )
            if text_ids:
                key = D.cache_key(
                    kind="text", target=fingerprint, ids=text_ids, top_k=o.top_k, quant=o.target_quantization
                )
                task = progress.add_task(f"{src.spec}: target logits", total=None)
                seqs += D.teacher_texts(
                    target,
                    text_ids,
                    D.ShardStore(work / "data" / key),
                    window=256,
                    batch_size=o.generate_batch,
                    top_k=o.top_k,
                    progress=lambda i, n, t=task: progress.update(t, completed=i, total=n),
                )
            if pairs:
                seqs += _teach_pairs(target, pairs, work, fingerprint, o, progress, f"{src.spec}: captured requests")
            stats[src.spec] = {"sequences": len(seqs), "tokens": sum(s.supervised for s in seqs)}
            train_seqs += seqs
        if captured_heldout:  # the captured answers as they were served: what the deployment's acceptance is
            heldout_seqs = _teach_pairs(
                target, captured_heldout, work, fingerprint, o, progress, "held-out captured requests"
            )
        else:
            heldout_seqs = _answers(
                answerer, heldout, work, fingerprint, o, 0.0, 0, o.eval_tokens, eos, progress, f"{HELDOUT}: answers"
            )
        del answerer
    if not train_seqs or not sum(s.supervised for s in train_seqs):
        raise DistillError("the data gave no tokens to learn from")
    console.print(
        "data: "
        + ", ".join(f"{escape(k)} {v['sequences']} sequences / {v['tokens']:,} tokens" for k, v in stats.items())
        + f"; held out{' (captured)' if captured_heldout else ''}: {len(heldout_seqs)} answers / "
        + f"{sum(s.supervised for s in heldout_seqs):,} tokens",
        highlight=False,
    )

    # 3. the draft
    head_file = work / "head.pt"
    if start is not None:
        head_ids = start.head_ids
    elif head_file.is_file():
        head_ids = torch.load(head_file, weights_only=True)["head_ids"]
    else:
        head_ids = M.choose_head(
            D.token_counts(train_seqs, info.vocab_size), o.head_tokens, [t for t in (eos,) if t is not None]
        )
        torch.save({"head_ids": head_ids}, head_file)
    draft = M.make_draft(target, layers, init=o.init, head_ids=head_ids, seed=o.seed)
    if start is not None:
        M.load_own_state(draft, start.state, o.init_from)
    draft = draft.to(device)
    del target
    if isinstance(draft.lm_head, M.subset_head.SubsetHead):
        draft.lm_head.full_vocab = False

    # 4. training
    examples = T.prepare(train_seqs, head_ids, info.vocab_size)
    heldout_examples = T.prepare(heldout_seqs, head_ids, info.vocab_size)
    meta = {
        "trtspec": __version__,
        "command": reproduce_command(o),
        "target": o.target,
        "layers_from_target": layers,
        "init_from": o.init_from,
        "head_tokens": int(head_ids.numel()) if head_ids is not None else info.vocab_size,
        "options": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(o).items() if k not in ("output", "resume")
        },
        "data": stats,
        "heldout": {"prompts": len(heldout_seqs), "tokens": sum(s.supervised for s in heldout_seqs)},
    }
    spec = _target_spec_for(output, o.target, target_path)
    history = _train(
        draft,
        examples,
        heldout_examples,
        o,
        work,
        device,
        console,
        save=lambda hist: M.write_asset(draft, output, spec, metadata=meta | {"history": hist}),
    )
    _report(history, console)
    console.print(
        f"draft in {escape(str(output))}: build it with `draft: {{checkpoint: {escape(str(output))}}}` in a build "
        "config",
        highlight=False,
    )
    return output


@dataclass
class _Start:
    layers: list[int]
    head_ids: torch.Tensor | None
    state: dict


def _initial_draft(spec: str, target_info, fingerprint: str) -> _Start:
    """The draft `--init-from` names: one `trtspec distill` wrote (its own weights and trtspec_shared.json), for
    this very target; DistillError naming the mismatch otherwise."""
    from safetensors.torch import load_file

    path = resolve_checkpoint_path(spec, Path.cwd())
    info = inspect_checkpoint(path)
    if info.shared is None:
        raise DistillError(
            f"--init-from {spec}: not a draft written by `trtspec distill` (no {SHARED_FILE}); only such a draft "
            "can be trained further here. Leave --init-from out to distill a new one"
        )
    if _fingerprint(info.shared.target) != fingerprint:
        raise DistillError(
            f"--init-from {spec} was distilled for the target {info.shared.spec!r}, not this --target; "
            "give the target it was made for"
        )
    recorded = {}
    if (path / "distill.json").is_file():
        recorded = json.loads((path / "distill.json").read_text())
    count = int(info.config["num_hidden_layers"])
    layers = recorded.get("layers_from_target") or M.default_layers(int(target_info.config["num_hidden_layers"]), count)
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(file)))
    head_ids = state.get("lm_head.token_ids")
    return _Start(list(layers), head_ids.long() if head_ids is not None else None, state)


def _teach_pairs(target, pairs, work, fingerprint, o, progress, label):
    # shards are numbered by batch: another batch size is another store
    key = D.cache_key(
        kind="captured",
        target=fingerprint,
        ids=pairs,
        top_k=o.top_k,
        quant=o.target_quantization,
        batch=o.generate_batch,
    )
    task = progress.add_task(label, total=None)
    return D.teacher_pairs(
        target,
        pairs,
        D.ShardStore(work / "data" / key),
        batch_size=o.generate_batch,
        top_k=o.top_k,
        progress=lambda i, n: progress.update(task, completed=i, total=n),
    )


def compact_forward(target, architecture: str, device):
    """The embedded engine's forward on the teacher's (rounded) weights: it answers the prompts, batched."""
    import copy

    from trtspec.engine.model import CompactModel

    config = copy.copy(target.config)
    config.architectures = [architecture]  # a model loaded from GGUF has none
    state = {name: t.detach() for name, t in target.state_dict().items()}
    return CompactModel(config, state, dtype=torch.float32, device=device)


def _answers(model, prompt_ids, work, fingerprint, o, temperature, seed, max_new_tokens, eos, progress, label):
    kind = "engine-answers" if o.answers_by == "engine" else "padded-answers"
    key = D.cache_key(
        kind=kind,
        target=fingerprint,
        ids=prompt_ids,
        temperature=temperature,
        seed=seed,
        max_new_tokens=max_new_tokens,
        top_k=o.top_k,
        quant=o.target_quantization,
        batch=o.generate_batch,
    )
    task = progress.add_task(label, total=None)
    return D.generate_answers(
        model,
        prompt_ids,
        D.ShardStore(work / "data" / key),
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        batch_size=o.generate_batch,
        top_k=o.top_k,
        seed=seed,
        eos_id=eos,
        progress=lambda i, n: progress.update(task, completed=i, total=n),
    )


def _load_checkpoint(checkpoint: Path, work: Path) -> dict:
    """The training checkpoint, read as tensors and plain values only: unpickling anything else runs code, and the
    work dir may have come from someone else (a shared output path, a run handed over for --resume)."""
    try:
        saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        what = f"it calls or builds `{found.group(1)}`" if found else "it holds objects"
        raise DistillError(
            f"{checkpoint} holds more than tensors and plain values ({what}), so it was not written by "
            f"`trtspec distill`; none of it was run. Remove {work} to start over"
        ) from None
    except (OSError, RuntimeError, EOFError) as exc:
        raise DistillError(f"{checkpoint} cannot be read ({exc}); remove {work} to start over") from None
    if not isinstance(saved, dict) or not {"model", "optimizer", "run", "torch_rng"} <= saved.keys():
        raise DistillError(f"{checkpoint} is not a distill checkpoint; remove {work} to start over")
    return saved


def _train(draft, examples, heldout, o: DistillOptions, work: Path, device, console, save) -> list[dict]:
    params = T.trainable(draft)
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=(0.9, 0.98), weight_decay=0.0)
    run = {"tokens": 0, "steps": 0, "epoch": 0, "cursor": 0, "seconds": 0.0, "last_eval": None, "history": []}
    checkpoint = work / CHECKPOINT_FILE
    if checkpoint.is_file():
        saved = _load_checkpoint(checkpoint, work)
        missing = set(saved["model"]) ^ set(M.own_state(draft))
        if missing:
            raise DistillError(
                f"{checkpoint} does not match this draft ({sorted(missing)[:3]}); remove {work} to start over"
            )
        draft.load_state_dict(saved["model"], strict=False)
        optimizer.load_state_dict(saved["optimizer"])
        run = saved["run"]
        torch.set_rng_state(saved["torch_rng"])
        console.print(f"resuming at {run['tokens']:,} tokens (step {run['steps']})", highlight=False)

    def evaluate_and_save():
        result = T.evaluate(draft, heldout, device)
        entry = {"tokens": run["tokens"], "steps": run["steps"], "seconds": round(run["seconds"], 1)} | result.summary()
        run["history"].append(entry)
        run["last_eval"] = run["tokens"]
        k4 = next((r for r in result.by_k if r["k"] == 4), result.by_k[-1])
        console.print(
            f"eval @ {run['tokens']:>9,} tokens: greedy acceptance {result.by_k[0]['acceptance']:.3f} (K=1), "
            f"{k4['acceptance']:.3f} (K={k4['k']}, {k4['tokens_per_call']:.2f} tokens/call); held-out KL "
            f"{result.kl:.3f}",
            highlight=False,
        )
        tmp = checkpoint.with_suffix(".tmp")
        torch.save(
            {
                "model": M.own_state(draft),
                "optimizer": optimizer.state_dict(),
                "run": run,
                "torch_rng": torch.get_rng_state(),
            },
            tmp,
        )
        os.replace(tmp, checkpoint)
        save(run["history"])

    if run["last_eval"] is None:
        evaluate_and_save()  # the untrained draft: the baseline of the table
    draft.train()
    kl_avg = None
    with _progress(console) as progress:
        task = progress.add_task("training", total=max(o.tokens, 1), completed=min(run["tokens"], o.tokens))
        while run["tokens"] < o.tokens:
            epoch = T.batches(examples, o.batch_tokens, seed=o.seed * 1000 + run["epoch"])
            while run["cursor"] < len(epoch) and run["tokens"] < o.tokens:
                start = time.perf_counter()
                for group in optimizer.param_groups:
                    group["lr"] = T.learning_rate(o.lr, run["tokens"], o.tokens)
                loss, entropy, n = T.loss_on(draft, [examples[i] for i in epoch[run["cursor"]]], device)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                kl = loss.item() - entropy / max(n, 1)
                kl_avg = kl if kl_avg is None else 0.95 * kl_avg + 0.05 * kl
                run["tokens"] += n
                run["steps"] += 1
                run["cursor"] += 1
                run["seconds"] += time.perf_counter() - start
                progress.update(
                    task,
                    completed=min(run["tokens"], o.tokens),
                    description=f"training: KL {kl_avg:.3f}, {run['tokens'] / max(run['seconds'], 1e-9):.0f} tokens/s",
                )
                if run["tokens"] - run["last_eval"] >= o.eval_every:
                    evaluate_and_save()
            if run["cursor"] >= len(epoch):
                run["epoch"] += 1
                run["cursor"] = 0
    if run["last_eval"] != run["tokens"]:
        evaluate_and_save()
    else:
        save(run["history"])
    return run["history"]


def _report(history: list[dict], console: Console) -> None:
    table = Table(title="greedy acceptance on held-out answers (teacher-forced replay of speculative decoding)")
    for col in ("tokens", "KL", "K=1", "K=2", "K=4", "K=6", "tokens/call K=4"):
        table.add_column(col, justify="right")
    for h in history:
        by_k = {r["k"]: r for r in h["by_k"]}
        table.add_row(
            f"{h['tokens']:,}",
            f"{h['kl']:.3f}",
            *(f"{by_k[k]['acceptance']:.3f}" if k in by_k else "-" for k in (1, 2, 4, 6)),
            f"{by_k[4]['tokens_per_call']:.2f}" if 4 in by_k else "-",
        )
    console.print(table)


# ---- helpers ----------------------------------------------------------------------------------------------------


def reproduce_command(o: DistillOptions) -> str:
    """The `trtspec distill` command line that makes this draft again (options that differ from the defaults)."""
    defaults = DistillOptions(target=o.target, output=o.output)
    parts = ["trtspec", "distill", "--target", o.target, "--output", str(o.output)]
    for key in (
        "layers",
        "init",
        "tokens",
        "seed",
        "head_tokens",
        "prompts",
        "samples",
        "temperature",
        "max_new_tokens",
        "target_quantization",
        "eval_every",
        "lr",
        "generate_batch",
        "answers_by",
        "threads",
        "init_from",
    ):
        value = getattr(o, key)
        if value != getattr(defaults, key) or key == "seed":
            parts += [f"--{key.replace('_', '-')}", str(value)]
    if o.data != defaults.data:
        for spec in o.data:
            parts += ["--data", spec]
    return " ".join(parts)


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def _check_state(work: Path, o: DistillOptions) -> None:
    """Write the run's defining options, or, resuming, check that they are unchanged."""
    path = work / STATE_FILE
    mine = json.loads(json.dumps(o.defining()))
    if path.is_file():
        saved = json.loads(path.read_text())["options"]
        saved.setdefault("answers_by", "engine")  # runs from before the option decoded with the engine
        changed = [k for k in DEFINING if saved.get(k) != mine.get(k)]
        if changed:
            raise DistillError(
                "--resume with other settings than the run it continues: "
                + ", ".join(f"{k} was {saved.get(k)!r}, now {mine.get(k)!r}" for k in changed)
                + "; use the same ones, or another --output"
            )
        return
    path.write_text(json.dumps({"trtspec": __version__, "options": mine}, indent=2) + "\n")


def _fingerprint(info) -> str:
    from trtspec.compile.common import describe_sources

    return D.cache_key(
        sources=[(s["file"].rsplit("/", 1)[-1], s["bytes"], s["sha256"]) for s in describe_sources(info)]
    )


def round_like_engine(model, quantization: str) -> None:
    """Give the teacher the engine's FP8 weight rounding (the engine computes with dequantized FP8 weights)."""
    if quantization == "none":
        return
    from trtspec.engine import fp8

    per_channel = quantization == "fp8-per-channel"
    with torch.no_grad():
        for name, param in model.named_parameters():
            if fp8.is_quantizable(name, param):
                q, scale = fp8.quantize(param, per_channel=per_channel)
                param.copy_(fp8.dequantize(q, scale, param.dtype))
