"""The built-in workload: multi-turn chats, as a trace in the segment form.

It follows :class:`kvoffload.workload.chat.ChatWorkload` (and takes its parameters
from one): every conversation starts with a shared system prompt, and turn ``t`` of a
user sends the whole conversation so far plus a new message, so each prompt extends
the user's previous prompt and answer. Two differences, both for scale: content is
named segments instead of materialized token ids (a 100,000-request workload would
otherwise be ~10^8 random tokens), and at most ``concurrent`` conversations are open
at once: requests go round-robin over the open conversations (the next turn of each
open user in turn) and a user who finished its ``turns`` is replaced by the next
user. With ``concurrent >= users`` the order is ChatWorkload's (turn 1 of every
user, then turn 2, ...). The working set is about ``concurrent`` histories.

Arrivals are a Poisson process of ``rate`` requests per second. Lengths and
arrivals come from two generators seeded by ``seed``: the same seed gives the same
workload, and changing the rate does not change the lengths.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from kvoffload.core.errors import UsageError
from kvoffload.simulate.trace import TraceRequest, TraceSummary, summarize
from kvoffload.workload.chat import ChatWorkload


@dataclass(frozen=True)
class ChatTrace:
    """A chat workload (shape from ``workload``) with concurrency and arrival rate."""

    workload: ChatWorkload
    concurrent: int = 256
    rate: float = 5.0  # requests per second
    system_prompts: int = 1  # distinct system prompts, assigned to users round-robin

    def __post_init__(self) -> None:
        w = self.workload
        checks = (
            ("--users", w.users >= 1),
            ("--turns", w.turns >= 1),
            ("--system-tokens", w.system_tokens >= 0),
            ("--user-tokens", 1 <= w.user_tokens[0] <= w.user_tokens[1]),
            ("--output-tokens", w.output_tokens >= 1),
            ("--concurrent-users", self.concurrent >= 1),
            ("--rate", self.rate > 0),
            ("--system-prompts", self.system_prompts >= 1),
        )
        for option, ok in checks:
            if not ok:
                raise UsageError(f"{option}: invalid value (see kvoffload simulate --help)")

    @property
    def num_requests(self) -> int:
        return self.workload.users * self.workload.turns

    def summary(self, fits: int) -> TraceSummary:
        """The workload's summary, from its parameters when every request surely has
        at most ``fits`` tokens (prompt and output; otherwise by generating it, which
        gives the exact largest request). ``unique_tokens`` is then the expectation."""
        w = self.workload
        lo, hi = w.user_tokens
        largest = w.system_tokens + w.turns * (hi + w.output_tokens)
        if largest > fits:
            return summarize(self.requests())
        per_turn = (lo + hi) / 2 + w.output_tokens
        unique = min(self.system_prompts, w.users) * w.system_tokens + int(
            self.num_requests * per_turn
        )
        return TraceSummary(
            requests=self.num_requests,
            prompt_tokens=0,  # not needed before simulating: not computed
            output_tokens=self.num_requests * w.output_tokens,
            unique_tokens=unique,
            duration_s=self.num_requests / self.rate,
            max_request_tokens=largest,
        )

    def describe(self) -> str:
        w = self.workload
        lo, hi = w.user_tokens
        return (
            f"chat: {w.users} users x {w.turns} turns, {self.concurrent} open at once, "
            f"system prompt {w.system_tokens} tokens, messages {lo}-{hi}, answers "
            f"{w.output_tokens}, {self.rate:g} requests/s"
        )

    def requests(self) -> Iterator[TraceRequest]:
        """The requests in arrival order (deterministic; see the module docstring)."""
        w = self.workload
        lengths = random.Random(f"kvoffload-chat/{w.seed}/lengths")
        arrivals = random.Random(f"kvoffload-chat/{w.seed}/arrivals")
        open_users: list[int] = list(range(min(self.concurrent, w.users)))
        next_user = len(open_users)
        history: dict[int, list[tuple[str, int]]] = {}
        turn_of: dict[int, int] = {}
        t = 0.0
        index = 0
        while open_users:
            for slot, user in enumerate(open_users):
                if user not in history:
                    system = [(f"sys{user % self.system_prompts}", w.system_tokens)]
                    history[user] = system if w.system_tokens else []
                    turn_of[user] = 0
                turn = turn_of[user]
                history[user].append((f"u{user}m{turn}", lengths.randint(*w.user_tokens)))
                answer = f"u{user}a{turn}"
                yield TraceRequest(
                    t,
                    w.output_tokens,
                    segments=tuple(history[user]),
                    output_id=answer,
                    where=f"generated request {index + 1}",
                )
                index += 1
                t += arrivals.expovariate(self.rate)
                history[user].append((answer, w.output_tokens))
                turn_of[user] = turn + 1
                if turn + 1 == w.turns:
                    del history[user], turn_of[user]
                    open_users[slot] = next_user if next_user < w.users else -1
                    next_user += 1
            open_users = [u for u in open_users if u >= 0]
