"""Training data for `trtspec distill`: what the target says, with its next-token distributions.

Two kinds of source, named by `--data`:
- prompts (`builtin:NAME`, or JSONL lines with {"prompt": ...}): the target answers each one in its chat template,
  greedily and by sampling; the raw logits of every generated position come out of the same generation;
- texts (a .txt file, or JSONL lines with {"text": ...} or {"messages": [...]}): used as written; one forward pass
  of the target gives the logits of every position;
- captured requests (a `trtspec serve --capture` directory, or JSONL lines with "input_ids" and "output_ids"): the
  prompt as the engine saw it and the target's answer; one forward pass gives the target's logits over the answer,
  the only positions learned (trtspec.capture). A share of them is held out as the evaluation set.

A `Sequence` keeps the token ids and, for the positions the draft learns, the target's top-k logits. Sequences are
stored on disk in shards as they are made, so a re-run or `--resume` reuses them instead of generating again.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import resources
from itertools import product
from pathlib import Path

import torch

from trtspec import capture
from trtspec.errors import TrtspecError

BUILTIN = "builtin:"
PROMPT_FILE = "assistant.json"
BUILTIN_SETS = ("assistant", "assistant-heldout")


class DistillError(TrtspecError):
    """Distillation that cannot start or go on: bad options, data or output dir; nothing was overwritten."""


@dataclass
class Source:
    """One `--data` entry: prompts for the target to answer and texts to learn as written."""

    spec: str
    prompts: list[str]
    texts: list[str]
    chats: list[list[dict]]
    captured: list[dict] = field(default_factory=list)  # trtspec.capture records


@dataclass
class Sequence:
    """Token ids; the target's top-k logits for predicting ids[first:] (row i predicts ids[first + i])."""

    ids: torch.Tensor  # int32 [L]
    first: int
    topk_ids: torch.Tensor  # int32 [L - first, k]
    topk_logits: torch.Tensor  # float16 [L - first, k]

    @property
    def supervised(self) -> int:
        return int(self.ids.numel()) - self.first


# ---- sources ----------------------------------------------------------------------------------------------------


def builtin_prompts(name: str, *, limit: int | None = None, seed: int = 0) -> list[str]:
    """A shipped prompt set: every template x topic of each category (held-out topics for `assistant-heldout`),
    then a seeded sample of `limit` prompts."""
    if name not in BUILTIN_SETS:
        raise DistillError(
            f"unknown prompt set '{BUILTIN}{name}'; choose one of {', '.join(BUILTIN + n for n in BUILTIN_SETS)}"
        )
    spec = json.loads((resources.files("trtspec") / "data" / "distill" / PROMPT_FILE).read_text())
    key = "heldout_topics" if name.endswith("-heldout") else "topics"
    prompts = [
        t.format(x=topic) for cat in spec["categories"].values() for t, topic in product(cat["templates"], cat[key])
    ]
    random.Random(seed).shuffle(prompts)
    return prompts[:limit] if limit else prompts


def read_source(spec: str, *, limit: int | None = None, seed: int = 0) -> Source:
    """Read one `--data` entry; raises DistillError naming the file and line that is wrong."""
    if spec.startswith(BUILTIN):
        return Source(spec, builtin_prompts(spec[len(BUILTIN) :], limit=limit, seed=seed), [], [])
    path = Path(spec).expanduser()
    if path.is_dir():
        try:
            return Source(spec, [], [], [], capture.read_records(path))
        except capture.CaptureError as exc:
            raise DistillError(f"--data {exc}") from None
    if not path.is_file():
        raise DistillError(
            f"--data {spec}: no such file (give a .txt or .jsonl file, a capture directory, or builtin:NAME)"
        )
    try:
        content = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DistillError(
            f"--data {spec}: not UTF-8 text (byte {exc.start}); give a .txt or .jsonl text file"
        ) from exc
    if "\x00" in content:
        raise DistillError(f"--data {spec}: holds NUL bytes, which is binary data, not text")
    if not content.strip():
        raise DistillError(f"--data {spec}: is empty")
    if path.suffix != ".jsonl":
        return Source(spec, [], [content], [])
    source = Source(spec, [], [], [])
    for number, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DistillError(f"--data {spec}, line {number}: not valid JSON ({exc.msg})") from exc
        if isinstance(item, dict) and isinstance(item.get("prompt"), str) and item["prompt"].strip():
            source.prompts.append(item["prompt"])
        elif isinstance(item, dict) and isinstance(item.get("text"), str) and item["text"].strip():
            source.texts.append(item["text"])
        elif isinstance(item, dict) and _is_chat(item.get("messages")):
            source.chats.append(item["messages"])
        elif capture.is_captured(item):
            source.captured.append(item)
        else:
            raise DistillError(
                f'--data {spec}, line {number}: expected an object with a non-empty "prompt" or "text" '
                'string, "messages": [{"role": ..., "content": ...}, ...], or captured "input_ids" and "output_ids"'
            )
    if limit:
        source.prompts = source.prompts[:limit]
    return source


def _is_chat(messages) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )


# ---- tokenizing -------------------------------------------------------------------------------------------------


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the user turn of the tokenizer's chat template, ready for the assistant's answer."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(prompt)["input_ids"]]


def tokenize_source(source: Source, tokenizer, vocab_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, text ids) of a source; raises DistillError when something does not tokenize into the vocabulary."""

    def check(what: str, text: str, ids: list[int]) -> list[int]:
        if not ids:
            raise DistillError(f"--data {source.spec}: {what} {_preview(text)} gives no tokens")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise DistillError(
                f"--data {source.spec}: {what} {_preview(text)} gives token id {bad}, outside the "
                f"target's vocabulary [0, {vocab_size}): the tokenizer does not belong to this target"
            )
        return ids

    try:
        prompts = [check("prompt", p, chat_ids(tokenizer, p)) for p in source.prompts]
        texts = [
            check("text", t, [int(i) for i in tokenizer(t, add_special_tokens=False)["input_ids"]])
            for t in source.texts
        ]
        for chat in source.chats:
            rendered = (
                tokenizer.apply_chat_template(chat, tokenize=False)
                if getattr(tokenizer, "chat_template", None)
                else "\n".join(m["content"] for m in chat)
            )
            texts.append(
                check("chat", rendered, [int(i) for i in tokenizer(rendered, add_special_tokens=False)["input_ids"]])
            )
    except DistillError:
        raise
    except Exception as exc:  # tokenizers raise many kinds on input they cannot handle
        raise DistillError(f"--data {source.spec}: the target's tokenizer cannot encode it: {exc}") from exc
    return prompts, texts


def _preview(text: str) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= 60 else text[:57] + "...")


# ---- the target's outputs, cached in shards -------------------------------------------------------------------------


def cache_key(**parts) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class ShardStore:
    """Sequences in numbered shard files under one folder; a shard is written whole (rename) or not at all."""

    def __init__(self, folder: Path):
        self.folder = folder

    def path(self, index: int) -> Path:
        return self.folder / f"shard-{index:05d}.pt"

    def has(self, index: int) -> bool:
        return self.path(index).is_file()

    def load(self, index: int) -> list[Sequence]:
        data = torch.load(self.path(index), weights_only=True)
        return [Sequence(*fields) for fields in zip(data["ids"], data["first"], data["topk_ids"], data["topk_logits"])]

    def save(self, index: int, sequences: list[Sequence]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        data = {
            "ids": [s.ids for s in sequences],
            "first": [s.first for s in sequences],
            "topk_ids": [s.topk_ids for s in sequences],
            "topk_logits": [s.topk_logits for s in sequences],
        }
        tmp = self.path(index).with_suffix(".tmp")
        torch.save(data, tmp)
        os.replace(tmp, self.path(index))


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = logits.float().topk(k, dim=-1)
    return ids.to(torch.int32).cpu(), values.to(torch.float16).cpu()


SHARD_BATCHES = 4  # batches' worth of answers per shard file


def generate_answers(
    model,
    prompts: list[list[int]],
    store: ShardStore,
    *,
    temperature: float,
    max_new_tokens: int,
    batch_size: int,
    top_k: int,
    seed: int,
    eos_id: int | None,
    progress: Callable[[int, int], None] | None = None,
) -> list[Sequence]:
    """The target's answers to `prompts` (greedy when temperature is 0), with the raw logits of each answer token.

    `model` is the embedded engine's compact forward (`trtspec.engine.model.CompactModel`): answers are what the
    deployed target says, `batch_size` rows at a time, a finished row's place going to the next prompt; or the
    transformers model on the same (rounded) weights, in padded batches of `batch_size` (`decode_answers_padded`,
    the fast way on a GPU).
    Shards hold SHARD_BATCHES batches' worth of prompts; a sampled answer is seeded by its prompt's index, so an
    interrupted run resumes at the first missing shard and produces the same sequences."""
    from trtspec.engine.model import CompactModel

    per_shard = batch_size * SHARD_BATCHES
    shards = [list(range(i, min(i + per_shard, len(prompts)))) for i in range(0, len(prompts), per_shard)]
    out: list[Sequence] = []
    for index, shard in enumerate(shards):
        if not store.has(index):
            decode = decode_answers if isinstance(model, CompactModel) else decode_answers_padded
            store.save(
                index,
                decode(
                    model,
                    [prompts[i] for i in shard],
                    shard,
                    temperature=temperature,
                    max_new_tokens=max_new_tokens,
                    batch_size=batch_size,
                    top_k=top_k,
                    seed=seed,
                    eos_id=eos_id,
                ),
            )
        out += store.load(index)
        if progress:
            progress(index + 1, len(shards))
    return out


@torch.inference_mode()
def decode_answers(
    model,
    prompts: list[list[int]],
    numbers: list[int],
    *,
    temperature: float,
    max_new_tokens: int,
    batch_size: int,
    top_k: int,
    seed: int,
    eos_id: int | None,
) -> list[Sequence]:
    """Decode the prompts `batch_size` rows at a time, one token per row and step, each until its end token (kept,
    with its logits: the draft learns to end too) or `max_new_tokens`."""
    from trtspec.engine.model import Segment

    answers: list[list[int]] = [[] for _ in prompts]
    kept: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]  # top-k (ids, logits) per token
    generators = [torch.Generator().manual_seed(seed * 1_000_003 + n) for n in numbers] if temperature > 0 else None
    waiting, running, kvs = list(range(len(prompts))), [], {}
    segments: list[Segment] = []
    while waiting or running:
        while waiting and len(running) < batch_size:  # admit: the new row's prompt goes through in this step
            row = waiting.pop(0)
            kvs[row] = model.new_kv(len(prompts[row]) + max_new_tokens)
            running.append(row)
            segments.append(Segment(prompts[row], 0, kvs[row], 1))
        logits = model.forward(segments)
        still = []
        for row, x in zip(running, logits):
            raw = x[-1].float().cpu()
            if generators is None:
                token = int(raw.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(raw / temperature, dim=-1), 1, generator=generators[row]))
            answers[row].append(token)
            kept[row].append(_topk(raw, top_k))
            if token != eos_id and len(answers[row]) < max_new_tokens:
                still.append(row)
            else:
                del kvs[row]
        running = still
        segments = [Segment([answers[r][-1]], len(prompts[r]) + len(answers[r]) - 1, kvs[r], 1) for r in running]
    sequences = []
    for ids, answer, top in zip(prompts, answers, kept):
        sequences.append(
            Sequence(
                torch.tensor(ids + answer, dtype=torch.int32),
                len(ids),
                torch.stack([i for i, _ in top]),
                torch.stack([v for _, v in top]),
            )
        )
    return sequences


@torch.inference_mode()
def decode_answers_padded(
    model,
    prompts: list[list[int]],
    numbers: list[int],
    *,
    temperature: float,
    max_new_tokens: int,
    batch_size: int,
    top_k: int,
    seed: int,
    eos_id: int | None,
) -> list[Sequence]:
    """The same answers as `decode_answers`, decoded by the transformers model in left-padded batches: every row
    of a batch steps until all have ended, so a GPU runs `batch_size` rows per step with a few hundred kernel
    launches whatever the batch (the compact forward's attention is one call per row). Sampled answers draw from
    one generator on the model's device, seeded by `seed` and the batch's first prompt number: reproducible on
    the same device and batch size, not bitwise across devices."""
    from transformers import DynamicCache

    device = model.device
    sequences: list[Sequence] = []
    for at in range(0, len(prompts), batch_size):
        batch = prompts[at : at + batch_size]
        width = max(map(len, batch))
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        generator = (
            torch.Generator(device=device).manual_seed(seed * 1_000_003 + numbers[at]) if temperature > 0 else None
        )
        cache = DynamicCache()
        chosen, top_ids, top_values = [], [], []
        ended = torch.zeros(len(batch), dtype=torch.bool, device=device)
        for _ in range(max_new_tokens):
            logits = (
                model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                .logits[:, -1]
                .float()
            )
            if generator is None:
                token = logits.argmax(-1)
            else:
                token = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)[:, 0]
            values, indices = logits.topk(top_k, dim=-1)
            chosen.append(token)
            top_ids.append(indices.to(torch.int32))
            top_values.append(values.to(torch.float16))
            if eos_id is not None:
                ended |= token == eos_id
                if bool(ended.all()):
                    break
            ids, positions = token[:, None], positions[:, -1:] + 1
            mask = torch.cat([mask, mask.new_ones(len(batch), 1)], dim=1)
        chosen_t = torch.stack(chosen, 1).cpu()
        top_ids_t, top_values_t = torch.stack(top_ids, 1).cpu(), torch.stack(top_values, 1).cpu()
        for row, prompt in enumerate(batch):
            answer = chosen_t[row].tolist()
            length = answer.index(eos_id) + 1 if eos_id in answer else len(answer)  # the end token is kept
            sequences.append(
                Sequence(
                    torch.tensor(prompt + answer[:length], dtype=torch.int32),
                    len(prompt),
                    top_ids_t[row, :length].contiguous(),
                    top_values_t[row, :length].contiguous(),
                )
            )
    return sequences


def teacher_texts(
    model,
    texts: list[list[int]],
    store: ShardStore,
    *,
    window: int,
    batch_size: int,
    top_k: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[Sequence]:
    """Texts as written, cut into windows of `window` tokens, with the target's logits at every position."""
    windows = [ids[i : i + window] for ids in texts for i in range(0, max(len(ids) - 1, 1), window - 1)]
    windows = [w for w in windows if len(w) >= 2]
    batches = [windows[i : i + batch_size] for i in range(0, len(windows), batch_size)]
    out: list[Sequence] = []
    for index, batch in enumerate(batches):
        if not store.has(index):
            store.save(index, _teacher_batch(model, batch, top_k))
        out += store.load(index)
        if progress:
            progress(index + 1, len(batches))
    return out


@torch.inference_mode()
def _teacher_batch(model, batch: list[list[int]], top_k: int) -> list[Sequence]:
    width = max(map(len, batch))
    input_ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
    logits = model(input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device)).logits
    sequences = []
    for row, ids in enumerate(batch):
        top_ids, top_values = _topk(logits[row, : len(ids) - 1], top_k)
        sequences.append(Sequence(torch.tensor(ids, dtype=torch.int32), 1, top_ids, top_values))
    return sequences


def captured_pairs(source: Source, vocab_size: int, window: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of a source's captured requests, cut to `window` tokens (the prompt's start goes
    first); raises DistillError when an id is not in the target's vocabulary (captured from another model)."""
    pairs = []
    for n, record in enumerate(source.captured, 1):
        prompt, answer = [int(t) for t in record["input_ids"]], [int(t) for t in record["output_ids"]]
        bad = next((t for t in prompt + answer if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise DistillError(
                f"--data {source.spec}: captured request {n} holds token id {bad}, outside the target's vocabulary "
                f"[0, {vocab_size}): it was captured from another model"
            )
        answer = answer[: window - 1]
        pairs.append((prompt[-(window - len(answer)) :], answer))
    return pairs


def teacher_pairs(
    model,
    pairs: list[tuple[list[int], list[int]]],
    store: ShardStore,
    *,
    batch_size: int,
    top_k: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[Sequence]:
    """Captured (prompt, answer) pairs with the target's logits over the answer: the draft learns the answer only."""
    batches = [pairs[i : i + batch_size] for i in range(0, len(pairs), batch_size)]
    out: list[Sequence] = []
    for index, batch in enumerate(batches):
        if not store.has(index):
            whole = _teacher_batch(model, [p + a for p, a in batch], top_k)
            store.save(
                index,
                [
                    Sequence(s.ids, len(p), s.topk_ids[len(p) - 1 :], s.topk_logits[len(p) - 1 :])
                    for s, (p, _) in zip(whole, batch)
                ],
            )
        out += store.load(index)
        if progress:
            progress(index + 1, len(batches))
    return out


def token_counts(sequences: Iterable[Sequence], vocab_size: int) -> torch.Tensor:
    """How often the target emits each token: the supervised tokens and, where they differ, its top-1 choices."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in sequences:
        counts += torch.bincount(s.ids[s.first :].long(), minlength=vocab_size)
        counts += torch.bincount(s.topk_ids[:, 0].long(), minlength=vocab_size)
    return counts
