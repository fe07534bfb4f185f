"""OpenAI's Predicted Outputs on code edits, against target-only and prompt lookup, interleaved in one run.

    trtspec serve --repo REPO --openai-port 9000 &
    python benchmarks/predicted_outputs.py --openai-url http://127.0.0.1:9000 [--num-prompts 8] [--max-tokens 256]

The prompts are the built-in code-edit set (each asks for an edit of the code it holds and the code back), sent to
`/v1/chat/completions`, greedy, one request at a time. Each prompt goes through every arm, in a new random order per
prompt (so drift in the machine's speed hits every arm alike), after a one-token request of the same prompt that
puts it in the engines' prefix cache:

    target          num_draft_tokens 0: the target alone
    auto            the deployment's default speculation (prompt lookup and the draft model), no prediction
    lookup          speculation prompt_lookup: prompt lookup alone
    predicted       the default speculation with `prediction` = the code in the prompt (the original file)
    unrelated       the default speculation with `prediction` = another prompt's code
    exact           the default speculation with `prediction` = the target's own answer (from a first pass): the
                    ceiling of any drafter here, since every draft it makes is accepted until the engine's
                    max_draft_len

Reported per arm: output tokens / summed seconds, its ratio to the target arm and to auto, output tokens per target
call (the BLS's iterations: what the timing's noise does not move), and usage's accepted / rejected prediction tokens.
Every arm must give the target's text (greedy): a prompt where one does not is counted.
Goals: predicted >= 2.5x target and above lookup; unrelated >= 0.97x auto.

`--bound TOKENIZER_DIR` (the target engine's folder) also prices two drafters of the original code over the target's
own answers: an oracle, which drafts at each position the longest run of the original that the answer continues with
(up to max_draft_len tokens) and decodes plainly where none does, what no drafter of the original can beat; and a
re-aligning drafter, which knows only what the answer has said so far (it drafts the original from where the answer
last followed it, re-aligned on the last two tokens' nearest match). Verification passes are priced at the exact
arm's seconds per iteration, plain steps at the target arm's seconds per token, both from this run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import sys
import time
import urllib.parse
from pathlib import Path

from common import add_num_prompts  # benchmarks/common.py, beside this script
from rich.console import Console
from rich.table import Table

CODE = re.compile(r"```[a-z]*\n(.*?)```", re.DOTALL)
ARMS = ("target", "auto", "lookup", "predicted", "unrelated", "exact")


def code_edit_prompts() -> list[tuple[str, str]]:
    """(prompt, the code it holds) of the built-in code-edit set."""
    path = Path(__file__).resolve().parents[1] / "trtspec/data/prompts/code-edit.jsonl"
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            prompt = json.loads(line)["prompt"]
            if m := CODE.search(prompt):
                out.append((prompt, m.group(1)))
    return out


class Front:
    """POST /v1/chat/completions on one keep-alive connection (standard library: no client library's cost)."""

    def __init__(self, url: str, api_key: str | None):
        parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=900)
        self.headers = {"Content-Type": "application/json"} | (
            {"Authorization": f"Bearer {api_key}"} if api_key else {}
        )
        self.model = self._call("GET", "/v1/models")["data"][0]["id"]

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        self.conn.request(method, path, json.dumps(body) if body is not None else None, self.headers)
        resp = self.conn.getresponse()
        data = json.loads(resp.read())
        if resp.status != 200:
            sys.exit(f"{method} {path}: HTTP {resp.status}: {data}")
        return data

    def chat(self, prompt: str, max_tokens: int, extra: dict) -> tuple[float, dict]:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **extra,
        }
        start = time.perf_counter()
        out = self._call("POST", "/v1/chat/completions", body)
        return time.perf_counter() - start, out


def arm_fields(arm: str, code: str, other: str, answer: str, fixed: int | None = None) -> dict:
    """`fixed`: lookup, predicted and unrelated draft from prompt lookup (and their prediction) at that fixed K, with
    no draft model and no cost model: the sources compared alone."""
    alone = {"speculation": "prompt_lookup", "num_draft_tokens": fixed, "adaptive_draft_length": False} if fixed else {}
    return {
        "target": {"num_draft_tokens": 0},
        "auto": {},
        "lookup": alone or {"speculation": "prompt_lookup"},
        "predicted": alone | {"prediction": {"type": "content", "content": code}},
        "unrelated": alone | {"prediction": {"type": "content", "content": other}},
        "exact": alone | {"prediction": {"type": "content", "content": answer}},
    }[arm]


def drafter_steps(tokenizer_dir: str, prompts, answers: list[str], k: int) -> dict[str, tuple[int, int]]:
    """(verification passes, plain steps) over the answers of two drafters of the original code (module's doc)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    steps = {"oracle": [0, 0], "re-aligning": [0, 0]}
    for (_, code), answer in zip(prompts, answers):
        out = tok(answer, add_special_tokens=False)["input_ids"]
        original = tok(code, add_special_tokens=False)["input_ids"]
        for name, step in (("oracle", _oracle_run), ("re-aligning", _realigned_run)):
            i, at = 0, 0
            while i < len(out):
                run, at = step(out, i, original, at, k)
                steps[name][0 if run is not None else 1] += 1
                i += (run or 0) + 1
    return {name: tuple(v) for name, v in steps.items()}


def _common(a: list[int], i: int, b: list[int], j: int, k: int) -> int:
    m = 0
    while m < k and j + m < len(b) and i + m < len(a) and b[j + m] == a[i + m]:
        m += 1
    return m


def _oracle_run(out, i, original, at, k):
    """The longest run of the original the answer continues with at i (None: decode plainly)."""
    run = max((_common(out, i, original, j, k) for j in range(len(original))), default=0)
    return (run or None), at


def _realigned_run(out, i, original, at, k, n: int = 2):
    """Draft the original from `at`, where the answer follows it; once the answer's last n tokens are not the n before
    `at`, re-align on their nearest match at or after `at`, or decode plainly: what a drafter can know, not the
    future."""
    if i >= n and (at < n or out[i - n : i] != original[at - n : at]):
        hits = [j + n for j in range(len(original) - n + 1) if original[j : j + n] == out[i - n : i]]
        if not hits:
            return None, at
        at = min((h for h in hits if h >= at), default=hits[0])
    if at >= len(original):
        return None, at
    run = _common(out, i, original, at, k)
    return run, at + run + 1  # the target's own token follows the run: the next call sees whether it was the original's


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--openai-url", default="http://127.0.0.1:9000")
    parser.add_argument("--api-key", help="the front's key, where it asks for one")
    add_num_prompts(parser, 8, "how many of the code-edit prompts")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="each prompt's arms this many times, reordered each time")
    parser.add_argument("--fixed", type=int, help="K: lookup, predicted and unrelated at this fixed K (see arm_fields)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="write the per-request records here (JSON)")
    parser.add_argument("--bound", metavar="TOKENIZER_DIR", help="also price two drafters of the original (see above)")
    parser.add_argument("--max-draft-len", type=int, default=8, help="their longest draft (the engine's)")
    args = parser.parse_args()

    front = Front(args.openai_url, args.api_key)
    prompts = code_edit_prompts()[: args.num_prompts]
    rng = random.Random(args.seed)
    totals = {arm: [0, 0.0, 0, 0, 0] for arm in ARMS}  # tokens, seconds, accepted/rejected prediction tokens, calls
    mismatches = {arm: 0 for arm in ARMS}
    records = []
    # the target's answers, for the exact arm (greedy: every arm must give them again)
    answers = [
        front.chat(prompt, args.max_tokens, {"num_draft_tokens": 0})[1]["choices"][0]["message"]["content"]
        for prompt, _ in prompts
    ]
    for i, (prompt, code) in [(i, p) for _ in range(args.rounds) for i, p in enumerate(prompts)]:
        other = prompts[(i + 1) % len(prompts)][1]
        front.chat(prompt, 1, {"num_draft_tokens": 0})  # the prompt into the prefix cache, for every arm alike
        order = list(ARMS)
        rng.shuffle(order)
        texts = {}
        for arm in order:
            seconds, out = front.chat(prompt, args.max_tokens, arm_fields(arm, code, other, answers[i], args.fixed))
            usage = out["usage"]
            details = usage.get("completion_tokens_details") or {}
            texts[arm] = out["choices"][0]["message"]["content"]
            t = totals[arm]
            t[0] += usage["completion_tokens"]
            t[1] += seconds
            t[2] += details.get("accepted_prediction_tokens", 0)
            t[3] += details.get("rejected_prediction_tokens", 0)
            t[4] += (out.get("speculation") or {}).get("iterations") or 0
            records.append(
                {"prompt": i, "arm": arm, "seconds": seconds, "usage": usage, "speculation": out.get("speculation")}
            )
        for arm in ARMS:
            mismatches[arm] += texts[arm] != texts["target"]
        print(f"prompt {i}: " + ", ".join(f"{r['arm']} {r['seconds']:.1f}s" for r in records[-len(ARMS) :]))

    rate = {arm: t[0] / t[1] for arm, t in totals.items()}
    title = f"Predicted outputs, code edits ({len(prompts)} prompts x {args.rounds}, max_tokens {args.max_tokens}, C=1"
    title += f", fixed K={args.fixed})" if args.fixed else ")"
    table = Table(title=title)
    columns = ("arm", "tokens", "tokens/s", "vs target", "vs auto", "tokens/call", "accepted", "rejected", "differs")
    for col in columns:
        table.add_column(col, justify="left" if col == "arm" else "right")
    for arm in ARMS:
        t = totals[arm]
        table.add_row(
            arm,
            str(t[0]),
            f"{rate[arm]:.1f}",
            f"{rate[arm] / rate['target']:.2f}x",
            f"{rate[arm] / rate['auto']:.2f}x",
            f"{t[0] / t[4]:.2f}" if t[4] else "-",
            str(t[2]),
            str(t[3]),
            str(mismatches[arm]),
        )
    Console(width=140).print(table)
    if args.bound:
        t_plain = totals["target"][1] / totals["target"][0]
        t_pass = totals["exact"][1] / max(totals["exact"][4], 1)
        tokens = totals["target"][0] / args.rounds
        print(f"priced at {t_pass * 1e3:.1f} ms a verification and {t_plain * 1e3:.1f} ms a plain token:")
        for name, (passes, plain) in drafter_steps(args.bound, prompts, answers, args.max_draft_len).items():
            speed = tokens * t_plain / (passes * t_pass + plain * t_plain)
            print(f"  {name} drafter: {passes} verifications, {plain} plain steps, {speed:.2f}x target")
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "records": records}, indent=1))
    return 0 if not any(mismatches.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
