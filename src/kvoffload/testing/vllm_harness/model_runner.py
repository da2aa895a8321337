"""The harness's model runner: what vLLM's model runner computes in one step.

It reads vLLM's scheduler output and writes the fake model's KV (``kv_model.py``)
into the engine blocks of the rank it runs on, each KV cache group through its own
block table, checking first that every position a request reads holds that
request's own KV: a full-attention group reads every computed position, a
sliding-window group only those its window still reads (vLLM's own rule,
``get_num_skipped_tokens`` of the group's manager). Owns nothing but the token view
of each request (``tokens``: what its last step computed over).
"""

from __future__ import annotations

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

from kvoffload.core.jobs import StepPlan
from kvoffload.testing.vllm_harness.checks import HarnessViolation
from kvoffload.testing.vllm_harness.kv_model import KVModel, ReadMismatch


class ModelRunner:
    def __init__(self, scheduler: Scheduler, model: KVModel) -> None:
        self.scheduler = scheduler
        self.model = model
        self.block_size = model.block_size
        self.tokens: dict[str, list[int]] = {}

    @property
    def managers(self) -> tuple[SingleTypeKVCacheManager, ...]:
        """vLLM's block manager of each KV cache group."""
        return tuple(self.scheduler.kv_cache_manager.coordinator.single_type_managers)

    def check_groups(self, windows: tuple[int | None, ...]) -> None:
        """vLLM's scheduler manages exactly the KV cache groups ``windows`` names
        (None: full attention, else a sliding window), with its hybrid coordinator
        when there are several."""
        coordinator = type(self.scheduler.kv_cache_manager.coordinator).__name__
        want = "HybridKVCacheCoordinator" if len(windows) > 1 else "UnitaryKVCacheCoordinator"
        got = [getattr(m, "sliding_window", None) for m in self.managers]
        kinds = [type(m).__name__ for m in self.managers]
        expected = [
            ("FullAttentionManager" if w is None else "SlidingWindowManager") for w in windows
        ]
        if coordinator != want or kinds != expected or got != list(windows):
            raise HarnessViolation(
                f"vLLM runs {coordinator} over {kinds} (windows {got}); the harness asked for "
                f"{want} over {expected} (windows {list(windows)})"
            )

    def tables(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table of each KV cache group."""
        return self.scheduler.kv_cache_manager.get_block_ids(request_id)

    def computed(self, output: SchedulerOutput) -> dict[str, int]:
        computed = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        return computed

    def inputs(self, output: SchedulerOutput, in_flight: dict[str, int]) -> None:
        """The token ids this step computes over, as vLLM's model runner sees them:
        the request's tokens, plus (async) the token sampled by the step still in
        flight, which the scheduler has not applied yet."""
        computed = self.computed(output)
        for request_id, count in output.num_scheduled_tokens.items():
            tokens = list(self.scheduler.requests[request_id].all_token_ids)
            end = computed[request_id] + count
            if len(tokens) < end and request_id in in_flight:
                tokens.append(in_flight[request_id])
            if len(tokens) < end:
                raise HarnessViolation(
                    f"{request_id!r}: positions up to {end} scheduled, {len(tokens)} tokens known"
                )
            self.tokens[request_id] = tokens

    def sample(self, output: SchedulerOutput) -> dict[str, int]:
        """A token for every request whose scheduled positions end its known tokens
        (vLLM's model runner samples every request not in a partial prefill)."""
        sampled: dict[str, int] = {}
        computed = self.computed(output)
        for request_id, count in output.num_scheduled_tokens.items():
            if not self.scheduler.requests[request_id].is_prefill_chunk:
                tokens = self.tokens[request_id][: computed[request_id] + count]
                sampled[request_id] = self.model.sample(request_id, tokens)
        return sampled

    def forward(self, output: SchedulerOutput, step: int, rank: int) -> None:
        """One rank's forward pass: every scheduled request reads, in every group, the
        computed positions the group reads (checked) and writes the positions
        scheduled now."""
        computed = self.computed(output)
        for request_id, count in output.num_scheduled_tokens.items():
            tokens = self.tokens[request_id]
            start = computed[request_id]
            for group, blocks in enumerate(self.tables(request_id)):
                first = self.managers[group].get_num_skipped_tokens(start)
                try:
                    self.model.check(
                        request_id, tokens, blocks, first, start, group=group,
                        what=f"step {step} forward", ranks=[rank],
                    )  # fmt: skip
                except ReadMismatch as exc:
                    raise HarnessViolation(str(exc)) from None
                self.model.write(
                    request_id, tokens, blocks, start, start + count, group=group, ranks=[rank]
                )

    def written(self, output: SchedulerOutput, plan: StepPlan) -> set[int]:
        """The engine blocks this step writes, in any group (one memory): its forward
        pass and its loads."""
        written: set[int] = set()
        computed = self.computed(output)
        for request_id, count in output.num_scheduled_tokens.items():
            start = computed[request_id]
            for blocks in self.tables(request_id):
                written.update(blocks[p // self.block_size] for p in range(start, start + count))
        for load in plan.loads:
            written.update(load.moved_blocks())
        written.discard(self.model.null_block)
        return written
