"""What cutting stop strings costs the OpenAI front's event loop per streamed token: StopText (one automaton for all
stop strings) against the rule it replaced (a find and a hold-back probe per stop string per token), on the same text.

    python benchmarks/stop_text.py

Prints microseconds a token (the best of 3 runs of 400 tokens) and what building the stop strings costs a request."""

from __future__ import annotations

import random
import string
import time

from trtspec.openai_api.stops import StopText


class PerStop:
    """The former rule: every stop string searched in the text, then probed from its longest prefix down for a
    tail to hold back."""

    def __init__(self, stops: list[str]):
        self.stops, self.pending, self.stopped = stops, "", False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return buf[: min(hits)]
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]


def per_token(cls, stops: list[str], tokens: list[str]) -> float:
    tokens = tokens[:20] if len(stops) > 1000 else tokens  # the former rule takes ~50 ms a token there
    best = float("inf")
    for _ in range(3):
        cutter = cls(stops)
        start = time.perf_counter()
        for token in tokens:
            cutter.push(token)
        best = min(best, (time.perf_counter() - start) / len(tokens))
        assert not cutter.stopped
    return best * 1e6


def build(stops: list[str]) -> float:
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        StopText(stops)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    rng = random.Random(0)
    words = "the of and to in is that for it as was with be by on not this are or from at which but have an".split()
    prose = [" " + rng.choice(words) for _ in range(400)]  # 3-5 characters a token, as English text
    letters = string.ascii_letters
    cases = [
        ("4 short stops", ["\n\n", "###", "</s>", "User:"], prose),
        ("16 x 256 random characters (the limit)", ["".join(rng.choices(letters, k=256)) for _ in range(16)], prose),
        # the former rule's worst case at the limit: a 255-character tail held back (the text repeats the start of
        # the last stop string) and probed against the 15 others from their longest prefix down
        (
            "16 x 256, a 255-character tail held back",
            ["c" * 255 + chr(ord("A") + i) for i in range(15)] + ["a" * 255 + "b"],
            ["aaaa"] * 400,
        ),
        ("50,000 x 20 (1 MB of JSON, refused now)", ["".join(rng.choices(letters, k=20)) for _ in range(50000)], prose),
    ]
    print(f"{'stop strings':48s} {'per stop':>12s} {'automaton':>12s} {'build':>10s}")
    for name, stops, tokens in cases:
        old, new = per_token(PerStop, stops, tokens), per_token(StopText, stops, tokens)
        print(f"{name:48s} {old:9.1f} us {new:9.1f} us {build(stops):7.2f} ms")


if __name__ == "__main__":
    main()
