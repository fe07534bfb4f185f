"""The prompts a benchmark sends: the built-in sets, a JSONL file, random tokens of a tokenizer, each
numbered per request and in the target's chat template when asked; and the option lists of `trtspec bench`."""

from __future__ import annotations

import os
import random
import re
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from trtspec.errors import BenchError

BUILTIN = "builtin:"
PROMPT_SETS = ("chat", "code-edit", "summarize")
RANDOM = "random"  # made from the deployment's tokenizer, not shipped
# What a predicted-outputs workload sends as each prompt's `prediction` (OpenAI's Predicted Outputs): the code the
# prompt holds (the file being edited: the answer mostly repeats it), or another prompt's code (a wrong prediction)
PREDICTIONS = ("original", "unrelated")
_CODE = re.compile(r"```[A-Za-z0-9_+-]*\n(.*?)```", re.DOTALL)


# ---- prompts ------------------------------------------------------------------------------------------------


def builtin_prompt_path(name: str) -> Path:
    """The JSONL file of a prompt set shipped with trtspec (trtspec/data/prompts/NAME.jsonl)."""
    if name not in PROMPT_SETS:
        raise BenchError(
            f"unknown prompt set '{BUILTIN}{name}'; choose one of "
            + ", ".join(BUILTIN + n for n in (*PROMPT_SETS, RANDOM))
            + ", or give a JSONL file"
        )
    return Path(str(resources.files("trtspec") / "data" / "prompts" / f"{name}.jsonl"))


def load_prompt_set(source: str, tokenizer_dir: str | os.PathLike | None = None) -> list[str]:
    """Prompts from `builtin:NAME` or a file: JSONL with {"prompt": ...} per line, or one prompt per line.
    `builtin:random` is made from the tokenizer in `tokenizer_dir` (see random_token_prompts)."""
    from trtspec.validate import ValidationError, load_prompts

    if source == BUILTIN + RANDOM:
        if tokenizer_dir is None:
            raise BenchError(
                f"{BUILTIN}{RANDOM} draws its prompts from a tokenizer's vocabulary: give --chat-template "
                "(e.g. the target engine dir)"
            )
        return random_token_prompts(_load_tokenizer(tokenizer_dir))
    path = builtin_prompt_path(source[len(BUILTIN) :]) if source.startswith(BUILTIN) else Path(source)
    try:
        return load_prompts(path)
    except ValidationError as exc:
        raise BenchError(str(exc)) from exc


def random_token_prompts(tokenizer, count: int = 16, length: int = 32, seed: int = 0) -> list[str]:
    """`count` prompts of `length` tokens drawn uniformly from the tokenizer's ordinary tokens (no special tokens,
    none that decode to a broken character), with a fixed seed: the adversarial case for any draft, whose text
    neither a draft model nor prompt lookup can predict."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    pieces = tokenizer.batch_decode([[i] for i in ids])
    usable = [i for i, piece in zip(ids, pieces) if piece.strip() and "\ufffd" not in piece]
    rng = random.Random(seed)
    return [tokenizer.decode([rng.choice(usable) for _ in range(length)]) for _ in range(count)]


def predictions(texts: Sequence[str], kind: str) -> list[str]:
    """Each prompt's prediction (PREDICTIONS): the code in its fenced block, or that of the next prompt's."""
    codes = []
    for i, text in enumerate(texts):
        found = _CODE.search(text)
        if found is None:
            raise BenchError(
                f"--prediction: prompt {i + 1} holds no fenced code block (```...```) to predict the answer from; "
                f"use {BUILTIN}code-edit or prompts that quote the text they edit"
            )
        codes.append(found.group(1))
    if kind == "original":
        return codes
    if len(codes) < 2:
        raise BenchError("--prediction unrelated: takes another prompt's code, and there is one prompt")
    return codes[1:] + codes[:1]


def _load_tokenizer(tokenizer_dir: str | os.PathLike):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot load a tokenizer from {tokenizer_dir}: {exc}") from exc


class Prompts:
    """The texts a run sends: raw prompts, optionally as the user turn of a chat template, optionally numbered.

    `text(i, number)`: prompt i, starting with "#number " when numbering is on (see the module doc), inside the
    tokenizer's chat template when one was given. The BLS tokenizes text as given, so the template is applied
    here, client side, with the target's tokenizer (`trtspec build` copies it into the target engine dir)."""

    def __init__(
        self,
        texts: Sequence[str],
        *,
        tokenizer_dir: str | os.PathLike | None = None,
        numbered: bool = True,
        prediction: str | None = None,
    ):
        if not texts:
            raise BenchError("no prompts to send")
        self.texts = list(texts)
        self.numbered = numbered
        self.predictions = predictions(self.texts, prediction) if prediction else None  # PREDICTIONS
        self.tokenizer = None
        if tokenizer_dir is not None:
            self.tokenizer = _load_tokenizer(tokenizer_dir)
            if not getattr(self.tokenizer, "chat_template", None):
                raise BenchError(
                    f"the tokenizer in {tokenizer_dir} has no chat template; leave --chat-template out to "
                    "send the prompts as they are"
                )

    def __len__(self) -> int:
        return len(self.texts)

    def text(self, index: int, number: int | None = None) -> str:
        content = self.texts[index]
        if self.numbered and number is not None:
            content = f"#{number} {content}"
        if self.tokenizer is None:
            return content
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )


def parse_int_list(text: str, option: str, *, minimum: int) -> list[int]:
    """ "1,4,8" -> [1, 4, 8]: integers >= minimum, unique, sorted."""
    values: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise BenchError(f"{option}: '{part}' is not an integer (give e.g. 1,4,8)") from None
        if value < minimum:
            raise BenchError(f"{option}: {value} is below {minimum}")
        values.add(value)
    if not values:
        raise BenchError(f"{option}: give at least one value")
    return sorted(values)
