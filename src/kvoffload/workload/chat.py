"""A multi-turn chat workload with a shared system prompt and growing histories.

Every user's conversation starts with the same system prompt. Turn ``t`` of a user
sends the whole conversation so far (system prompt, earlier user messages and
earlier answers) plus a new user message, so each prompt extends the previous
prompt of the same user: the prefix-reuse pattern offloading serves. Answers are
synthetic token ids standing in for the model's output (the next prompt carries
them, as a chat client would).

Requests are interleaved round-robin (turn 1 of every user, then turn 2, ...), so
the working set is every user's history at once. Deterministic for a given seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class ChatRequest:
    user: int
    turn: int
    prompt: tuple[int, ...]
    output_tokens: int


@dataclass(frozen=True)
class ChatWorkload:
    users: int = 8
    turns: int = 6
    system_tokens: int = 512
    user_tokens: tuple[int, int] = (64, 256)
    output_tokens: int = 64
    vocab: int = 1000
    first_token: int = 3  # ids below are left to special tokens
    seed: int = 0

    def requests(self) -> list[ChatRequest]:
        rng = random.Random(self.seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(self.first_token, self.vocab) for _ in range(n)]

        system = tokens(self.system_tokens)
        history = [list(system) for _ in range(self.users)]
        out: list[ChatRequest] = []
        for turn in range(self.turns):
            for user in range(self.users):
                history[user] += tokens(rng.randint(*self.user_tokens))
                out.append(ChatRequest(user, turn, tuple(history[user]), self.output_tokens))
                history[user] += tokens(self.output_tokens)
        return out

    def working_set_tokens(self) -> int:
        """Tokens of every user's final history (what a cache must hold to hit all)."""
        return sum(len(r.prompt) + r.output_tokens for r in self.requests()[-self.users :])
