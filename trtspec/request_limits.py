"""What one request may ask of the BLS: the bounds in trtspec.serving_settings, checked before work is spent on them.

Each check raises RequestError (INVALID_ARG, HTTP 400) naming the request's field, the limit and the setting that
holds it. Pure Python: the BLS (trtspec.triton.bls) calls these, and each rule is tested without a server.
"""

from __future__ import annotations

import math

from trtspec.errors import RequestError
from trtspec.serving_settings import ServingSettings


def deadline_ms(asked: int, limit: int) -> tuple[int, bool]:
    """A request's deadline in ms from its arrival (0: none) from its timeout_ms (`asked`, 0 when it names none) and
    the deployment's request_timeout_ms (`limit`, 0: no limit), and whether that deadline is the deployment's: a
    client may shorten the deployment's limit, never lift it (0, or more than the limit, is the limit)."""
    if asked < 0:
        raise RequestError("timeout_ms", f"must be >= 0 (0: the deployment's request_timeout_ms), got {asked}")
    if asked and (not limit or asked < limit):
        return asked, False
    return limit, True


def deadline_advice(timeout_ms: int, deployments: bool) -> str:
    """What a request that ran past its deadline is told."""
    if deployments:
        return (
            f"the request ran past {timeout_ms} ms, the deployment's request_timeout_ms (the most a request may "
            "take); ask for fewer max_tokens"
        )
    return f"the request ran past its {timeout_ms} ms; give it a longer timeout_ms, or fewer max_tokens"


def check_prompt_chars(text: str, settings: ServingSettings) -> None:
    """A prompt longer than max_input_chars is refused before the tokenizer spends time on it."""
    if len(text) > settings.max_input_chars:
        raise RequestError(
            "text_input",
            f"the prompt is {len(text)} characters; this deployment takes at most {settings.max_input_chars} "
            f"(max_input_chars, for max_input_len {settings.max_input_len} tokens)",
        )


def check_words(name: str, words: list[str], settings: ServingSettings) -> None:
    """stop_words or bad_words: at most max_stop_words / max_bad_words of them, each at most max_word_chars long,
    checked before any is tokenized."""
    most = settings.max_stop_words if name == "stop_words" else settings.max_bad_words
    if len(words) > most:
        raise RequestError(name, f"{len(words)} words; this deployment takes at most {most} (max_{name})")
    longest = max(map(len, words), default=0)
    if longest > settings.max_word_chars:
        raise RequestError(
            name,
            f"a word of {longest} characters; this deployment takes words of at most {settings.max_word_chars} "
            "(max_word_chars)",
        )


def check_returned_logits(rows: dict[str, int], vocab: int, settings: ServingSettings) -> None:
    """`rows`: the logits rows a request asks for by kind ("context": its prompt's length, "generation": its
    max_tokens); refused, naming the last kind's field, when rows x `vocab` exceeds max_returned_logits."""
    tokens = sum(rows.values())
    if rows and tokens * vocab > settings.max_returned_logits:
        names = " and ".join(f"return_{kind}_logits" for kind in rows)
        parts = ", ".join(f"{n} {kind}" for kind, n in rows.items())
        raise RequestError(
            f"return_{list(rows)[-1]}_logits",
            f"{names} would return {tokens * vocab} logits ({tokens} tokens x {vocab} vocabulary: {parts}); this "
            f"deployment returns at most {settings.max_returned_logits} (max_returned_logits): ask for fewer "
            "max_tokens or a shorter prompt",
        )


def finite(name: str, value: float) -> float:
    """A float field's value, refused when NaN or infinite (NaN passes every range check; inf divides to NaN)."""
    if not math.isfinite(value):
        raise RequestError(name, f"must be a finite number, got {value}")
    return value


def utf8(name: str, value: bytes) -> str:
    """A string tensor's element as text: UTF-8 (a lone surrogate's bytes are not), else the request's fault."""
    try:
        return value.decode()
    except UnicodeDecodeError as exc:
        raise RequestError(name, f"is not valid UTF-8 (byte {exc.start}: {exc.reason}); send UTF-8 text") from None
