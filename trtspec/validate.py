"""`trtspec validate outputs`: does speculation change what the target says?

Under greedy decoding speculative decoding must return the target's own tokens. For each prompt the target-only
path (num_draft_tokens 0) and the speculative path for each draft length K run through `tensorrt_llm_bls`; their
token ids are compared. At the first differing position the target engine is asked for its logits of the
next token after prompt + common prefix (`SpecClient.engine_logits`), and the difference is classified:

    near-tie:  |z[a] - z[b]| <= tie_tolerance * max(1, max_v |z_v|)
    mismatch:  otherwise

where a is the target-only token, b the speculative one and z the target's logits there. The default tolerance
1e-2 is the rounding error of a logit computed in bf16 (8 significant bits: 2^-8 ~ 4e-3 per operation, a few
operations deep) or FP8 with higher-precision accumulation: two tokens closer than that can swap places when
the same logits are computed in a different batch shape (verifying K+1 positions at once versus one at a time),
which is not a fault of the speculative algorithm. A real mismatch is a bug.

The prompt ids for `engine_logits` must be the ones the BLS used: they come from a local tokenizer when one is
given (`--tokenizer DIR`, encoded with special tokens as the BLS does), else from the deployment's
`preprocessing` model, which loads the same tokenizer as the BLS. As a check, the target's argmax at the
position must be (within the tolerance) the target-only token; if it is not, the row says so (tokenization or
a nondeterministic target) and counts as a mismatch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trtspec.client import ClientError, SpecClient
from trtspec.errors import TrtspecError
from trtspec.generation import Completion

DEFAULT_TIE_TOLERANCE = 1e-2
DEFAULT_KS = (1, 4, 8)
# Short and varied (code, prose, lists, numbers, repetition, JSON, dialogue): they fit small max_input_len.
DEFAULT_PROMPTS = (
    "def fibonacci(n):\n",
    "The quick brown fox",
    "Once upon a time there was",
    "1 2 3 4 5",
    "Triton serves models over HTTP and gRPC;",
    '{"name": "trtspec", "version":',
    "Q: What is speculative decoding?\nA:",
    "the the the the",
)

NEAR_TIE = "near-tie"
MISMATCH = "mismatch"


class ValidationError(TrtspecError):
    """A prompts file that cannot be read, or a bad option."""


# ---- pure pieces ------------------------------------------------------------------------------------------------


def compare_tokens(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where `a` and `b` differ (a shorter sequence differs where it ends), or None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def load_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: JSONL with {"prompt": ...} per line, or plain text with one prompt per line.

    The file is JSONL when its first non-blank line starts with "{"; then every non-blank line must be an object
    with a string "prompt". Blank lines are skipped in both forms; a plain-text line keeps its inner spaces."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValidationError(f"cannot read the prompts file {path}: {exc}") from exc
    numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise ValidationError(f"the prompts file {path} has no prompts")
    if not numbered[0][1].lstrip().startswith("{"):
        return [line.rstrip("\r") for _, line in numbered]
    prompts = []
    for i, line in numbered:
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ValidationError(
                f'{path}:{i}: not a JSON object ({exc}); write one {{"prompt": ...}} per line'
            ) from exc
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise ValidationError(f'{path}:{i}: expected an object with a non-empty string "prompt"')
        prompts.append(obj["prompt"])
    return prompts


def parse_ks(text: str) -> list[int]:
    """ "1,4,8" -> [1, 4, 8] (positive, unique, in order given)."""
    ks: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise ValidationError(f"--ks: '{part}' is not a positive integer (give e.g. 1,4,8)")
        if int(part) not in ks:
            ks.append(int(part))
    if not ks:
        raise ValidationError("--ks: give at least one draft length, e.g. 1,4,8")
    return ks


@dataclass(frozen=True)
class Verdict:
    kind: str  # NEAR_TIE or MISMATCH
    gap: float  # |z[expected] - z[got]|
    allowed: float  # tolerance * scale
    argmax: int  # the target's top token at the position
    consistent: bool  # the target's argmax is (within `allowed`) the target-only token
    note: str = ""


def classify(logits: np.ndarray, expected: int, got: int | None, tolerance: float = DEFAULT_TIE_TOLERANCE) -> Verdict:
    """Near-tie or mismatch between the target-only token `expected` and the speculative token `got` (None: the
    speculative output ended there without an end token to compare), from the target's logits at that position."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1)
    scale = max(1.0, float(np.max(np.abs(z))))
    allowed = tolerance * scale
    top = int(np.argmax(z))
    consistent = 0 <= expected < z.size and z[top] - z[expected] <= allowed
    if got is None or not 0 <= got < z.size:
        return Verdict(MISMATCH, float("inf"), allowed, top, consistent, "no speculative token to compare")
    gap = abs(float(z[expected] - z[got]))
    if not consistent:
        return Verdict(
            MISMATCH,
            gap,
            allowed,
            top,
            False,
            "the target's logits there do not favour its own output: check the tokenization",
        )
    return Verdict(NEAR_TIE if gap <= allowed else MISMATCH, gap, allowed, top, True)


# ---- the run ----------------------------------------------------------------------------------------------------


@dataclass
class Difference:
    prompt_index: int
    k: int
    position: int
    expected: int | None  # target-only token (None: the target-only output ended there)
    got: int | None  # speculative token (None: the speculative output ended there)
    expected_text: str = ""
    got_text: str = ""
    verdict: Verdict | None = None
    error: str = ""  # why there is no verdict

    @property
    def kind(self) -> str:
        return self.verdict.kind if self.verdict is not None else MISMATCH


@dataclass
class KResult:
    k: int
    runs: int = 0
    matches: int = 0
    accepted_draft_tokens: int = 0
    draft_tokens: int = 0
    tokens: int = 0
    seconds: float = 0.0
    baseline_tokens: int = 0
    baseline_seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    differences: list[Difference] = field(default_factory=list)

    @property
    def near_ties(self) -> int:
        return sum(d.kind == NEAR_TIE for d in self.differences)

    @property
    def mismatches(self) -> int:
        return sum(d.kind == MISMATCH for d in self.differences)

    @property
    def acceptance(self) -> float | None:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def baseline_tokens_per_second(self) -> float:
        return self.baseline_tokens / self.baseline_seconds if self.baseline_seconds > 0 else 0.0


@dataclass
class Report:
    prompts: list[str]
    max_tokens: int
    tolerance: float
    results: list[KResult]
    errors: list[str] = field(default_factory=list)  # target-only failures
    skipped_ks: list[int] = field(default_factory=list)

    @property
    def differences(self) -> list[Difference]:
        return [d for r in self.results for d in r.differences]

    def passed(self, allow_near_ties: bool = False) -> bool:
        if self.errors or any(r.errors for r in self.results):
            return False
        kinds = {d.kind for d in self.differences}
        return MISMATCH not in kinds and (allow_near_ties or NEAR_TIE not in kinds)


class Tokens:
    """Prompt ids and token text for the report: a local tokenizer, or the deployment's pre/postprocessing models."""

    def __init__(self, client: SpecClient, tokenizer_dir: str | Path | None = None):
        self.client = client
        self.tokenizer = None
        if tokenizer_dir is not None:
            from transformers import AutoTokenizer

            try:
                self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
            except (OSError, ValueError) as exc:
                raise ValidationError(f"cannot load a tokenizer from {tokenizer_dir}: {exc}") from exc
        self._end_id: int | None = None

    @property
    def source(self) -> str:
        return "local tokenizer" if self.tokenizer is not None else "preprocessing model"

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
        ids, self._end_id = self.client.tokenize(text)
        return ids

    def end_id(self) -> int | None:
        if self.tokenizer is not None:
            return self.tokenizer.eos_token_id
        return self._end_id

    def decode(self, token_id: int | None) -> str:
        if token_id is None:
            return "(end)"
        try:
            if self.tokenizer is not None:
                text = self.tokenizer.decode([token_id])
            else:
                text = self.client.detokenize([token_id])
        except (ClientError, ValueError, TypeError):
            text = "?"
        return f"{text!r} ({token_id})"


def run_validation(
    client: SpecClient,
    prompts: Sequence[str],
    ks: Sequence[int],
    *,
    max_tokens: int,
    tokens: Tokens | None = None,
    tolerance: float = DEFAULT_TIE_TOLERANCE,
    engine_model: str = "tensorrt_llm",
    fixed_k: bool = True,
    speculation: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> Report:
    """Run every prompt target-only and with each K (greedy), compare, and explain each first difference.
    `fixed_k`: draft exactly K every iteration, so that drafts are really verified (the adaptive draft length may
    stop drafting, and a check in which nothing was drafted compares target-only with itself); False: the
    deployment's own draft-length policy, for figures of what a request gets by default. `speculation`: the draft
    source of the speculative requests (default: the deployment's)."""
    fields = {"adaptive_draft_length": False} if fixed_k else {}
    if speculation:
        fields["speculation"] = speculation
    tokens = tokens or Tokens(client)
    say = progress or (lambda _msg: None)
    report = Report(list(prompts), max_tokens, tolerance, [KResult(k) for k in ks])
    greedy = {"max_tokens": max_tokens, "top_k": 1, "return_perf_metrics": True}
    for k in (0, *ks[:1]):  # the first requests of a fresh server pay for warm-up: keep them out of the timings
        try:
            client.generate(prompts[0], max_tokens=min(max_tokens, 4), num_draft_tokens=k, **fields)
        except ClientError:
            pass
    for i, prompt in enumerate(prompts):
        say(f"prompt {i + 1}/{len(prompts)}: target only")
        try:
            base = client.generate(prompt, num_draft_tokens=0, **greedy)
        except ClientError as exc:
            report.errors.append(f"prompt {i + 1}, target only: {exc}")
            continue
        for result in report.results:
            say(f"prompt {i + 1}/{len(prompts)}: K={result.k}")
            try:
                spec = client.generate(prompt, num_draft_tokens=result.k, **fields, **greedy)
            except ClientError as exc:
                result.errors.append(f"prompt {i + 1}: {exc}")
                continue
            _record(result, base, spec)
            at = compare_tokens(base.token_ids, spec.token_ids)
            if at is None:
                result.matches += 1
            else:
                result.differences.append(
                    explain(client, tokens, i, prompt, result.k, base, spec, at, tolerance, engine_model)
                )
    return report


def _record(result: KResult, base: Completion, spec: Completion) -> None:
    result.runs += 1
    result.accepted_draft_tokens += spec.accepted_draft_tokens or 0
    result.draft_tokens += spec.draft_tokens or 0
    result.tokens += len(spec.token_ids)
    result.seconds += spec.seconds
    result.baseline_tokens += len(base.token_ids)
    result.baseline_seconds += base.seconds


def explain(
    client: SpecClient,
    tokens: Tokens,
    prompt_index: int,
    prompt: str,
    k: int,
    base: Completion,
    spec: Completion,
    at: int,
    tolerance: float,
    engine_model: str,
) -> Difference:
    """The first difference of two outputs, with the target's verdict on it."""
    expected = base.token_ids[at] if at < len(base.token_ids) else None
    got = spec.token_ids[at] if at < len(spec.token_ids) else None
    diff = Difference(prompt_index, k, at, expected, got)
    try:
        prompt_ids = tokens.encode(prompt)
        end_id = tokens.end_id()
        # An output that stopped early stopped on the end token (not returned): compare against it.
        expected = end_id if expected is None else expected
        got = end_id if got is None else got
        diff.expected_text, diff.got_text = tokens.decode(diff.expected), tokens.decode(diff.got)
        if expected is None:
            diff.error = "the target-only output ended here and the end token is unknown"
            return diff
        logits = client.engine_logits(prompt_ids + base.token_ids[:at], model=engine_model)
        diff.verdict = classify(logits, expected, got, tolerance)
    except ClientError as exc:
        diff.error = f"cannot classify: {exc}"
    return diff


# ---- the report ---------------------------------------------------------------------------------------------


def render_report(report: Report, console, *, allow_near_ties: bool = False) -> None:
    from rich.markup import escape
    from rich.table import Table

    n = len(report.prompts)
    table = Table(title=f"target-only vs speculative, greedy, {n} prompts x {report.max_tokens} tokens")
    for col in ("K", "same", "ties", "mismatch", "errors", "accept", "target tok/s", "spec tok/s", "speed-up"):
        table.add_column(col, justify="right")
    for r in report.results:
        timed = r.runs > 0 and r.seconds > 0 and r.baseline_seconds > 0
        speedup = r.tokens_per_second / r.baseline_tokens_per_second if timed and r.baseline_tokens else None
        table.add_row(
            str(r.k),
            f"{r.matches}/{r.runs}",
            _color(r.near_ties, "yellow"),
            _color(r.mismatches, "red"),
            _color(len(r.errors), "red"),
            "-" if r.acceptance is None else f"{r.acceptance:.1%}",
            f"{r.baseline_tokens_per_second:.1f}" if timed else "-",
            f"{r.tokens_per_second:.1f}" if timed else "-",
            "-" if speedup is None else f"{speedup:.2f}x",
        )
    console.print(table)
    if report.skipped_ks:
        console.print(f"skipped K={','.join(map(str, report.skipped_ks))}: above the deployment's max_draft_len")

    if report.differences:
        details = Table(title="first differences (target logits at that position)")
        for col in ("prompt", "K", "pos", "target-only", "speculative", "gap", "allowed", "verdict"):
            details.add_column(col)
        for d in report.differences:
            v = d.verdict
            verdict = f"[yellow]{NEAR_TIE}[/]" if d.kind == NEAR_TIE else "[red]mismatch[/]"
            note = d.error or (v.note if v else "")
            if note:
                verdict += f" {escape(note)}"
            details.add_row(
                str(d.prompt_index + 1),
                str(d.k),
                str(d.position),
                escape(d.expected_text),
                escape(d.got_text),
                "-" if v is None else f"{v.gap:.3g}",
                "-" if v is None else f"{v.allowed:.3g}",
                verdict,
            )
        console.print(details)
    for error in report.errors + [e for r in report.results for e in (f"K={r.k}, {x}" for x in r.errors)]:
        console.print(f"[red]error:[/] {escape(error)}", highlight=False)
    if report.passed(allow_near_ties):
        ties = sum(r.near_ties for r in report.results)
        extra = f" ({ties} near-tie{'s' if ties != 1 else ''} allowed)" if ties else ""
        console.print(f"[green]PASS[/]: speculative outputs equal the target's{extra}")
    else:
        console.print("[red]FAIL[/]: " + _failure_summary(report, allow_near_ties))


def _failure_summary(report: Report, allow_near_ties: bool) -> str:
    parts = []
    mismatches = sum(r.mismatches for r in report.results)
    ties = sum(r.near_ties for r in report.results)
    errors = len(report.errors) + sum(len(r.errors) for r in report.results)
    if mismatches:
        parts.append(f"{mismatches} real mismatch{'es' if mismatches != 1 else ''}")
    if ties and not allow_near_ties:
        parts.append(f"{ties} near-tie{'s' if ties != 1 else ''} (pass --allow-near-ties to accept them)")
    if errors:
        parts.append(f"{errors} failed request{'s' if errors != 1 else ''}")
    return ", ".join(parts)


def _color(count: int, color: str) -> str:
    return f"[{color}]{count}[/]" if count else "0"


def deployment_max_draft_len(client: SpecClient) -> int | None:
    """The BLS's `max_draft_len` parameter (trtspec deployments have it), or None."""
    try:
        params = client.model_config(client.model).get("parameters", {})
        value = params.get("max_draft_len", {}).get("string_value", "")
        return int(value) if value.isdigit() else None
    except (ClientError, AttributeError):
        return None
