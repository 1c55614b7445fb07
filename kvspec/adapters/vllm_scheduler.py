"""kvspec's token-budget scheduler over vLLM's own v1 ``Scheduler``, driven without a model (tested: 0.33.0).

    kvspec check --impl kvspec.adapters.vllm_scheduler:factory

The scheduler is vLLM's (``vllm/v1/core/sched/scheduler.py``), with its own ``KVCacheManager`` of one
full-attention group: ``capacity + 1`` blocks of the manager kvspec hands it (block 0 is vLLM's null
block; kvspec block ``b`` is engine block ``b + 1``; the handed manager itself is not used).  Its
``VllmConfig`` reads a local ``config.json`` of a tiny Llama (no weights, no tokenizer, nothing
downloaded) under ``VLLM_TARGET_DEVICE=cpu``.  kvspec's ``BudgetConfig`` is vLLM's
``SchedulerConfig``: ``token_budget`` = ``max_num_batched_tokens``, ``max_running`` = ``max_num_seqs``,
``chunked_prefill`` = ``enable_chunked_prefill``, ``reserve_full_sequence`` =
``scheduler_reserve_full_isl``, ``policy`` = ``policy``.  ``max_model_len`` is what vLLM's startup
check allows: one request filling the KV cache (``capacity * B``), and no more than the budget
without chunked prefill (``SchedulerConfig`` refuses less).

* ``arrive(request)`` -> ``add_request`` of a ``Request`` (prompt copied; ``max_tokens``, EOS ignored;
  ``arrival_time`` = arrival index; ``priority``; vLLM's block hasher).
* ``step()`` -> ``schedule()``, then the forward the engine core would run, then
  ``update_from_output(scheduler_output, model_runner_output)``.  The forward is the adapter's: it
  writes each scheduled token's KV into the slot the block table names (as ``read`` in
  ``kvspec.adapters.vllm_kv_cache_manager``) and samples, for each request whose computed tokens
  caught up with its tokens, ``kvspec.spec.scheduler.sampled_token`` -- a fake
  ``ModelRunnerOutput``, as the engine's own scheduler tests build.  The report is read off
  ``SchedulerOutput`` (``num_scheduled_tokens`` in the order served, ``preempted_req_ids``; an
  admission is a request served that was not running; its cached tokens are its
  ``num_computed_tokens`` less its share) and the finished requests off the engine core outputs.
* ``abort(request_id)`` -> ``finish_requests(request_id, RequestStatus.FINISHED_ABORTED)``.
* ``snapshot()`` -> ``requests`` (arrival order), ``running``, ``waiting`` (the queue's order), each
  request's ``num_computed_tokens``, ``num_output_tokens`` and ``num_preemptions``, and the memory:
  the pool, each request's table in ``req_to_blocks``, its computed tokens, the slots written.

Emulated: no operation of the kind; the forward ``step`` runs between vLLM's two calls stands in
for the model runner (as vLLM's own scheduler tests do), and the memory's contents are its writes.
Not offered: nothing of the kind is left out (``priority`` is offered).  The shape is
``kvspec.spec.scheduler_v1``'s, as read from ``Scheduler.schedule``:
recompute only (``_preempt_request`` frees the blocks, ``num_computed_tokens = 0``,
``waiting.prepend_request``), the victim ``self.running[-1]`` under FCFS and ``max(self.running,
key=(priority, arrival_time))`` under priority (a victim already scheduled gives back its
``num_scheduled_tokens``), no admission in a step that preempted (``if not preempted_reqs``), chunked
prefill cut by the budget, and ``scheduler_reserve_full_isl``'s admission gate.  Conventions: the
pool's, as ``kvspec.adapters.vllm_kv_cache_manager`` declares; ``trusts_caller``: ``add_request``
takes a duplicate id over the first (``self.requests[request.request_id] = request``) and any
``n``, ``finish_requests`` ignores an unknown id.

Safety is judged on vLLM's own state and answers.  ``invariant_hits_probed_at_admission`` compares an
admission's reported cached tokens with the plan of the manager the scheduler was handed; vLLM's scheduler
probes its own ``KVCacheManager`` instead, so the rule is not reached here: the cached tokens reported are
vLLM's ``num_computed_tokens`` less the share, and ``invariant_kv_holds_computed_tokens`` judges what the
computed tokens' KV holds.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from types import SimpleNamespace
from typing import Any

from kvspec.adapters.vllm_kv_cache_manager import (
    CONVENTIONS,
    EnginePool,
    SlotMemory,
    engine,
    kv_cache_config,
    on_cpu,
)
from kvspec.spec.block_manager import ManagerState
from kvspec.spec.components import Offer
from kvspec.spec.implementation import Implementation
from kvspec.spec.prefix_cache import PrefixCachingManager
from kvspec.spec.scheduler import Request, RequestId, sampled_token
from kvspec.spec.scheduler_v1 import PRIORITY, BudgetConfig, BudgetReport, BudgetState, Entry

VERSION = "0.33.0"
TINY_LLAMA = {  # all ModelConfig reads: no weights, no tokenizer
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "float32",
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}


@functools.cache
def scheduler_engine() -> SimpleNamespace:
    """vLLM's scheduler and configs, imported on the CPU platform with the hub offline."""
    on_cpu()
    import vllm.platforms

    if not vllm.platforms.current_platform.device_type:
        # vLLM resolved its platform before VLLM_TARGET_DEVICE was set (an earlier import of its BlockPool,
        # say): let it resolve again, as the CPU one, which the configs below need
        vllm.platforms._current_platform = None
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    model_dir = tempfile.mkdtemp(prefix="kvspec-tiny-llama-")
    with open(os.path.join(model_dir, "config.json"), "w") as config_file:
        json.dump(TINY_LLAMA, config_file)
    return SimpleNamespace(
        CacheConfig=CacheConfig,
        ModelConfig=ModelConfig,
        SchedulerConfig=SchedulerConfig,
        VllmConfig=VllmConfig,
        Scheduler=Scheduler,
        ModelRunnerOutput=ModelRunnerOutput,
        RequestStatus=RequestStatus,
        StructuredOutputManager=StructuredOutputManager,
        model_dir=model_dir,
    )


def vllm_scheduler(capacity: int, block_size: int, config: BudgetConfig) -> Any:
    vllm = scheduler_engine()
    max_model_len = capacity * block_size if config.chunked_prefill else min(capacity * block_size, config.token_budget)
    scheduling = vllm.SchedulerConfig(
        max_num_seqs=config.max_running,
        max_num_batched_tokens=config.token_budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=config.chunked_prefill,
        scheduler_reserve_full_isl=config.reserve_full_sequence,
        policy=config.policy,
        is_encoder_decoder=False,
    )
    model = vllm.ModelConfig(
        model=vllm.model_dir, skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=max_model_len
    )
    cache = vllm.CacheConfig(block_size=block_size, enable_prefix_caching=True)
    whole = vllm.VllmConfig(scheduler_config=scheduling, model_config=model, cache_config=cache)
    cache.num_gpu_blocks = capacity + 1
    return vllm.Scheduler(
        vllm_config=whole,
        kv_cache_config=kv_cache_config(capacity, block_size, [None]),
        structured_output_manager=vllm.StructuredOutputManager(whole),
        block_size=block_size,
        hash_block_size=block_size,
        log_stats=False,
    )


class VllmBudgetScheduler:
    """vLLM's v1 ``Scheduler`` as ``kvspec.spec.scheduler_v1.BudgetScheduler``."""

    def __init__(self, manager: PrefixCachingManager, config: BudgetConfig) -> None:
        self._config = config
        self._size = manager.block_size
        self.engine = vllm_scheduler(manager.pool.capacity, manager.block_size, config)
        self._pool = EnginePool(self.engine.kv_cache_manager.block_pool)
        self._memory = SlotMemory(manager.block_size)
        self._requests: dict[RequestId, Request] = {}  # every request that arrived, as kvspec gave it
        self._finished: list[RequestId] = []
        self._steps = 0

    def arrive(self, request: Request) -> None:
        vllm = engine()
        sampling = vllm.SamplingParams(max_tokens=request.max_new_tokens, ignore_eos=True)
        sampling.update_from_generation_config({}, eos_token_id=TINY_LLAMA["eos_token_id"])
        self.engine.add_request(
            vllm.Request(
                request_id=str(request.request_id),
                prompt_token_ids=list(request.prompt),
                sampling_params=sampling,
                pooling_params=None,
                arrival_time=float(len(self._requests)),
                priority=request.priority,
                block_hasher=vllm.get_request_block_hasher(self._size, vllm.sha256),
            )
        )
        self._requests[request.request_id] = request

    def abort(self, request_id: RequestId) -> None:
        self.engine.finish_requests(str(request_id), scheduler_engine().RequestStatus.FINISHED_ABORTED)

    def step(self) -> BudgetReport:
        running = {request.request_id for request in self.engine.running}
        output = self.engine.schedule()
        served = [(int(rid), share) for rid, share in output.num_scheduled_tokens.items()]
        admitted = [rid for rid, _ in served if str(rid) not in running]
        cached = [
            (rid, self.engine.requests[str(rid)].num_computed_tokens - share)
            for rid, share in served
            if rid in admitted
        ]
        finished = self._forward(output)
        self._steps += 1
        return BudgetReport(
            served=tuple(served),
            preempted=tuple(sorted(int(rid) for rid in output.preempted_req_ids or ())),
            admitted=tuple(admitted),
            cached_tokens=tuple(cached),
            finished=tuple(finished),
        )

    def _forward(self, output: Any) -> list[RequestId]:
        """Write the KV of what was scheduled, sample for each request that caught up, hand vLLM the outputs."""
        ids, sampled = list(output.num_scheduled_tokens), []
        for rid in ids:
            request = self.engine.requests[rid]
            computed = request.num_computed_tokens  # advanced by schedule() already
            table = self._blocks(rid)
            self._memory.write(table, request.all_token_ids, computed - output.num_scheduled_tokens[rid], computed)
            caught_up = computed == request.num_tokens
            sampled.append([sampled_token(int(rid), 0, request.num_output_tokens)] if caught_up else [])
        runner = scheduler_engine().ModelRunnerOutput(
            req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled
        )
        outputs = self.engine.update_from_output(output, runner)
        finished = [int(o.request_id) for client in outputs.values() for o in client.outputs if o.finish_reason]
        self._finished += finished
        return finished

    def _blocks(self, rid: str) -> list[int]:
        """The engine's table of a request, read without creating one (``req_to_blocks`` is a defaultdict)."""
        tables = self.engine.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
        return [block.block_id for block in tables.get(rid, ())]

    def snapshot(self) -> BudgetState:
        scheduler = self.engine
        running_status = scheduler_engine().RequestStatus.RUNNING
        entries = tuple(
            Entry(
                request=self._requests[int(rid)],
                arrival=int(request.arrival_time),
                place="running" if request.status == running_status else "waiting",
                computed=request.num_computed_tokens,
                generated=request.num_output_tokens,
                preemptions=request.num_preemptions,
            )
            for rid, request in scheduler.requests.items()
        )
        return BudgetState(
            config=self._config,
            steps=self._steps,
            arrived=tuple(self._requests),
            entries=entries,
            running=tuple(int(request.request_id) for request in scheduler.running),
            waiting=tuple(int(request.request_id) for request in scheduler.waiting),
            finished=tuple(self._finished),
            memory=self._memory_state(),
        )

    def _memory_state(self) -> ManagerState:
        pool = self._pool.snapshot()
        tables = self.engine.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
        requests = self.engine.requests
        return ManagerState(
            block_size=self._size,
            pool=pool,
            tables={(int(rid), 0): tuple(b.block_id - 1 for b in blocks) for rid, blocks in tables.items()},
            tokens={
                (int(rid), 0): tuple(requests[rid].all_token_ids[: requests[rid].num_computed_tokens])
                for rid in tables
                if rid in requests
            },
            contents=self._memory.contents(pool),
        )


def factory() -> Implementation:
    """vLLM's v1 ``Scheduler`` as the token-budget scheduler; the managers and the rest are kvspec's."""
    scheduler_engine()  # fail here, with the engine's ImportError, when vLLM is not installed
    offer = Offer(VllmBudgetScheduler, operations={PRIORITY})
    name = f"vLLM {engine_version()} v1 Scheduler"
    return Implementation(name=name, conventions=CONVENTIONS, token_budget_scheduler=offer)


def engine_version() -> str:
    import vllm

    return str(vllm.__version__)
