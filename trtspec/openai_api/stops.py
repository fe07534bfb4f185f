"""Stop strings, cut from generated text as OpenAI does, with one automaton for all of them."""

from __future__ import annotations


class StopText:
    """Cuts generated text before the first stop string, as OpenAI does (the BLS stops on the stop words' tokens
    and keeps them in its output). Streaming, it holds back a tail that could be the start of a stop string.

    The stop strings make one automaton (Aho-Corasick): a character of text costs one step however many and however
    long the stop strings are, and the state is the longest tail of the text that begins a stop string, the tail to
    hold back. Text is cut before the first stop string to end (the longest one ending there), so the result is the
    same however the text arrives in chunks."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""
        self.stopped = False
        # node -> {character: node}; the node of the longest proper suffix that is also a node; its depth; the
        # length of the longest stop string ending at it (0: none)
        nxt: list[dict[str, int]] = [{}]
        fail, depth, match = [0], [0], [0]
        for stop in stops:
            node = 0
            for ch in stop:
                if (child := nxt[node].get(ch)) is None:
                    child = len(nxt)
                    nxt[node][ch] = child
                    nxt.append({}), fail.append(0), depth.append(depth[node] + 1), match.append(0)
                node = child
            match[node] = len(stop)
        queue = list(nxt[0].values())
        for node in queue:  # breadth first: a node's fail link is shallower, so it is done before the node
            for ch, child in nxt[node].items():
                f = fail[node]
                while f and ch not in nxt[f]:
                    f = fail[f]
                fail[child] = nxt[f].get(ch, 0) if node else 0
                match[child] = match[child] or match[fail[child]]
                queue.append(child)
        self._next, self._fail, self._depth, self._match = nxt, fail, depth, match
        self._state = 0

    def _step(self, state: int, ch: str) -> int:
        while state and ch not in self._next[state]:
            state = self._fail[state]
        return self._next[state].get(ch, 0)

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        state, step, match = self._state, self._step, self._match
        for i, ch in enumerate(text):
            state = step(state, ch)
            if match[state]:
                self.stopped = True
                buf, self.pending = self.pending + text[: i + 1], ""
                return buf[: len(buf) - match[state]]
        self._state = state
        buf = self.pending + text
        hold = self._depth[state]
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
