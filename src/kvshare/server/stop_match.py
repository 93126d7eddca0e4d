"""How much streamed text to hold back because it may be the start of a stop string.

`StopPrefixes(stops)` is an Aho-Corasick automaton over the stop strings: after reading a text,
its state is the longest suffix of the text that is a prefix of some stop string, so the length
to hold back is that state's depth. `Tail` feeds one stream's text into it incrementally: each
new character costs amortised O(1) (a goto lookup plus failure links), whatever the number and
length of the stop strings — re-slicing every prefix of every stop on each update cost
256 x 1,024 x 1,024 character comparisons per token and held the event loop for minutes.

Invariants: the automaton has at most sum(len(stop)) + 1 states and is built once per request
(shared by its choices); `Tail.held(text)` equals the brute-force "longest suffix of `text` that
is a proper prefix of a stop string" (tests/test_reliab_isolation.py checks it on random texts).
"""

from __future__ import annotations

from collections import deque


_CHARS = 0x110000  # goto key of (state, ch): state * _CHARS + ord(ch), one flat dict (no dict per state)


class StopPrefixes:
    """The automaton: `goto` (flat, see _CHARS), failure link and depth per state; state 0 is the
    empty prefix."""

    def __init__(self, stops: list[str]) -> None:
        goto: dict[int, int] = {}
        children: list[list[int]] = [[]]
        depth = [0]
        for s in stops:
            node = 0
            for ch in s[:-1]:  # proper prefixes only: a whole stop string is the engine's to cut
                key = node * _CHARS + ord(ch)
                nxt = goto.get(key)
                if nxt is None:
                    nxt = goto[key] = len(depth)
                    children[node].append(key)
                    children.append([])
                    depth.append(depth[node] + 1)
                node = nxt
        fail = [0] * len(depth)
        queue = deque(goto[k] for k in children[0])
        while queue:
            node = queue.popleft()
            for key in children[node]:
                nxt, code = goto[key], key - node * _CHARS
                f = fail[node]
                while f and f * _CHARS + code not in goto:
                    f = fail[f]
                fail[nxt] = goto.get(f * _CHARS + code, 0)
                queue.append(nxt)
        self.goto, self.fail, self.depth = goto, fail, depth

    def step(self, state: int, ch: str) -> int:
        """The state after reading `ch` in `state`."""
        goto, fail, code = self.goto, self.fail, ord(ch)
        while True:
            nxt = goto.get(state * _CHARS + code)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = fail[state]


class Tail:
    """One stream's position in a StopPrefixes automaton."""

    def __init__(self, prefixes: StopPrefixes) -> None:
        self.prefixes = prefixes
        self.fed = ""  # the text read so far
        self.state = 0

    def held(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        if not text.startswith(self.fed):  # the text changed behind what was read: read it again
            self.fed, self.state = "", 0
        step, state = self.prefixes.step, self.state
        for ch in text[len(self.fed):]:
            state = step(state, ch)
        self.fed, self.state = text, state
        return self.prefixes.depth[state]
