"""LLMEngine: requests in, token and text deltas out, one scheduled step at a time.

Size: LLMEngine's step loop (schedule, run, sample, detokenize, finish) and its warm-up; the
config and KV sizing are in config.py.
"""

from __future__ import annotations

import collections
import itertools
import logging
import sys
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.settings import env_float
from worker.engine.batch import BatchMetadata
from worker.engine.block_manager import BlockManager, staged_pool_blocks, staged_recent_blocks
from worker.engine.config import (
    GIB,
    ContextLengthExceeded,
    EngineConfig,
    check_kv_pool,
    context_limit,
    kv_budget_bytes,
    kv_staging_bits,
    kv_staging_layer_bits,
    size_text,
    step_token_budget,
)
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.runner import ModelRunner, SampledTokens, model_device, model_dtype
from worker.engine.sampler import TokenLogprobs, stop_by_token
from worker.engine.scheduler import ScheduledBatch, Scheduler
from worker.engine.sequence import PENDING_TOKEN, FinishReason, SamplingParams, Sequence
from worker.engine.state_slots import StateCheckpoints, StateSlotPool
from worker.models.cache import KVStaging
from worker.models.int4 import use_mma_kernels

log = logging.getLogger(__name__)

# Seconds past which one engine step is logged as slow (TOKENMILL_ENGINE_SLOW_STEP_S).
SLOW_STEP_S = env_float("TOKENMILL_ENGINE_SLOW_STEP_S", 1.0)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class RequestMetrics:
    arrival_time: float  # time.perf_counter() clock
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    """What one step produced for one request: a delta, or the whole result from `generate`."""

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    usage: Usage
    metrics: RequestMetrics
    error: str | None = None
    # With SamplingParams.logprobs: one entry per token of new_token_ids, in order.
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs, on the request's first output: one entry per prompt
    # token, None for the first (nothing predicts it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class _InFlight:
    """A launched decode step whose tokens the host has not read yet."""

    batch: ScheduledBatch
    tokens: SampledTokens
    token_index: list[int]  # per decode: index of its pending token in the output


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    pending_text: str = ""  # text from a step that emitted no token (the cancel flush)
    new_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs_sent: bool = False


class LLMEngine:
    def __init__(self, model: Any, tokenizer: Any = None, config: EngineConfig | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config = config or EngineConfig()
        self.eos_token_ids = frozenset(_eos_token_ids(config, tokenizer, model))
        if config.fuse_projections and hasattr(model, "fuse_projections"):
            model.fuse_projections()
        # int4 layers in the mma kernels' layout where those run (after fusing: it joins rows)
        use_mma_kernels(model, model_dtype(model), config.max_num_seqs)
        config.max_model_len = context_limit(config, model)
        config.max_num_batched_tokens = step_token_budget(config)
        self.kv_staging_bits = kv_staging_bits(config.kv_staging)
        self.kv_staging_layer_bits = kv_staging_layer_bits(config.kv_staging)
        if config.enable_prefix_caching and self.kv_staging_bits is not None:
            raise ValueError("prefix caching does not combine with kv_staging")
        if config.enable_prefix_caching and config.prefix_checkpoint_blocks < 1:
            raise ValueError("prefix_checkpoint_blocks must be >= 1")
        self.num_checkpoint_slots = 0
        # How steps ran, for the benchmarks: "overlapped" launched behind the step in flight (or
        # first of a run), "drained" waited for the step in flight first (the next batch was
        # not a launch ahead), "synchronous" ran without overlap (prefills, sampling on host).
        self.step_kinds: collections.Counter[str] = collections.Counter()
        if config.enable_prefix_caching:
            slots = config.prefix_checkpoint_slots
            default = 2 * config.max_num_seqs  # a tail per running sequence, as many keyed
            self.num_checkpoint_slots = default if slots is None else max(0, slots)
        num_blocks, num_compressed = self._kv_pool()
        staging = None
        if self.kv_staging_bits is not None:
            staging = KVStaging(num_compressed, *self.kv_staging_bits, self.kv_staging_layer_bits)
        self.runner = ModelRunner(
            model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            num_state_slots=config.max_num_seqs,
            kv_dtype=config.kv_dtype,
            state_dtype=config.state_dtype,
            device=config.device,
            max_model_len=config.max_model_len,
            cuda_graphs=config.cuda_graphs,
            pad_decode=config.pad_decode,
            staging=staging,
            num_checkpoint_slots=self.num_checkpoint_slots,
        )
        if self.runner.device.type == "cuda":  # the GPU's measured kernel settings, if any
            from worker.kernels import tuning

            tuning.apply(self.runner.device)
        self.runner.capture_graphs()  # no-op off CUDA
        if config.warm_up is None:  # resolved in place: the caller decides on warm_up() by it
            config.warm_up = self.runner.device.type == "cuda"
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            num_compressed_blocks=num_compressed if staging is not None else 0,
            window_pages=config.kv_staging_window_pages,
            anchor_pages=config.kv_staging_anchor_pages,
            first_compressed_block=self.runner.first_compressed_block,
            prefix_caching=config.enable_prefix_caching,
        )
        checkpoints = None
        if config.enable_prefix_caching and self.runner.has_state and self.runner.can_copy_state:
            checkpoints = StateCheckpoints(
                self.runner.first_checkpoint_slot, self.num_checkpoint_slots
            )
        self.scheduler = Scheduler(
            self.block_manager,
            StateSlotPool(config.max_num_seqs),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            prefill_gather_s=config.prefill_gather_s,
            prefill_gather_gap_s=config.prefill_gather_gap_s,
            checkpoints=checkpoints,
            checkpoint_blocks=config.prefix_checkpoint_blocks,
            needs_state=self.runner.has_state,
        )
        self._requests: dict[str, _Request] = {}
        self._finished_outside_step: list[RequestOutput] = []  # aborts, reported by next step()
        self._seq_ids = itertools.count()
        self.overlap_decode = self.runner.decode_inputs is not None and (
            config.overlap_decode is None or config.overlap_decode
        )
        self._in_flight: _InFlight | None = None
        self._last_batch: ScheduledBatch | None = None  # for the slow-step warning

    def _kv_pool(self) -> tuple[int, int]:
        """(recent blocks, compressed blocks): the whole pool recent without staging. With
        staging, the recent pages that max_num_seqs sequences need (`staged_pool_blocks`: their
        anchors, windows, written pages and a step's chunks), the rest of the pool compressed:
        num_kv_blocks counts both kinds, a byte budget is split by page sizes, and on a CPU the
        compressed pool holds max_num_seqs full-length sequences."""
        cfg = self.config
        if self.kv_staging_bits is None:
            return self._num_kv_blocks(), 0
        need = staged_recent_blocks(
            cfg.max_num_seqs,
            cfg.block_size,
            cfg.max_num_batched_tokens,
            cfg.kv_staging_window_pages,
            cfg.kv_staging_anchor_pages,
        )
        full = -(-cfg.max_num_seqs * cfg.max_model_len // cfg.block_size)
        if cfg.num_kv_blocks is not None:
            total, source = cfg.num_kv_blocks, f"num_kv_blocks={cfg.num_kv_blocks}"
            recent = min(need, total)
            compressed = total - recent
        else:
            probe = self._probe_cache(
                KVStaging(1, *self.kv_staging_bits, self.kv_staging_layer_bits)
            )
            recent_page = probe.kv_bytes_per_token() * cfg.block_size
            compressed_page = probe.compressed_kv_bytes_per_token() * cfg.block_size
            device = torch.device(cfg.device) if cfg.device else model_device(self.model)
            if recent_page == 0:  # no attention layers
                return full, 0
            if cfg.kv_cache_bytes is not None:
                budget, source = cfg.kv_cache_bytes, f"kv_cache_bytes={cfg.kv_cache_bytes}"
            elif device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                state = cfg.max_num_seqs * probe.state_bytes_per_sequence()
                budget = kv_budget_bytes(free, cfg.gpu_memory_fraction, state)
                source = f"gpu_memory_fraction={cfg.gpu_memory_fraction} of {size_text(free)} free"
            else:
                return need, full
            recent, compressed = staged_pool_blocks(
                budget,
                recent_page,
                compressed_page,
                cfg.max_num_seqs,
                cfg.block_size,
                cfg.max_num_batched_tokens,
                cfg.kv_staging_window_pages,
                cfg.kv_staging_anchor_pages,
            )
        check_kv_pool(recent + compressed, cfg.block_size, cfg.max_model_len, 0, source)
        return recent, compressed

    def _num_kv_blocks(self) -> int:
        """The KV pool's block count, by EngineConfig's order (a count, a byte budget, the GPU's
        free memory, room for max_num_seqs full-length sequences). A pool that cannot hold one
        sequence of max_model_len is refused here, with the numbers."""
        cfg = self.config
        full = -(-cfg.max_num_seqs * cfg.max_model_len // cfg.block_size)
        if cfg.num_kv_blocks is not None:
            blocks, source = cfg.num_kv_blocks, f"num_kv_blocks={cfg.num_kv_blocks}"
        else:
            per_token = self.kv_bytes_per_token()
            if per_token == 0:  # no attention layers: KV blocks cost nothing
                return full
            device = torch.device(cfg.device) if cfg.device else model_device(self.model)
            if cfg.kv_cache_bytes is not None:
                budget, source = cfg.kv_cache_bytes, f"kv_cache_bytes={cfg.kv_cache_bytes}"
            elif device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                slots = cfg.max_num_seqs + self.num_checkpoint_slots
                state = slots * self._probe_cache().state_bytes_per_sequence()
                budget = kv_budget_bytes(free, cfg.gpu_memory_fraction, state)
                source = (
                    f"gpu_memory_fraction={cfg.gpu_memory_fraction} of {free / GIB:.2f} GiB free, "
                    f"less {state / GIB:.2f} GiB of DeltaNet state for {cfg.max_num_seqs} sequences"
                )
            else:
                return full
            blocks = budget // (per_token * cfg.block_size)
        check_kv_pool(blocks, cfg.block_size, cfg.max_model_len, self.kv_bytes_per_token(), source)
        return blocks

    def _probe_cache(self, staging: KVStaging | None = None) -> Any:
        """A one-block, one-slot cache of the model's layout (for its per-token sizes)."""
        dtype = model_dtype(self.model)
        return self.model.allocate_cache(
            1,
            self.config.block_size,
            1,
            self.config.kv_dtype or dtype,
            self.config.device or "cpu",
            state_dtype=self.config.state_dtype or dtype,
            **({} if staging is None else {"staging": staging}),
        )

    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token of context, measured on a one-block cache."""
        if hasattr(self, "runner"):
            return int(self.runner.cache.kv_bytes_per_token())
        return int(self._probe_cache().kv_bytes_per_token())

    def state_bytes_per_sequence(self) -> int:
        return int(self.runner.cache.state_bytes_per_sequence())

    # --- requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already running")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer")
            encoded = self.tokenizer.encode(prompt)
            prompt_ids = list(getattr(encoded, "ids", encoded))
        else:
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.config.max_model_len:
            raise ContextLengthExceeded(len(prompt_ids), self.config.max_model_len)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        seq = Sequence(next(self._seq_ids), request_id, prompt_ids, params)
        if params.grammar is not None:  # a format the library cannot compile fails here
            seq.grammar = self.grammars.state(params.grammar)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, prompt_ids)
        self._requests[request_id] = _Request(seq, detokenizer)
        self.scheduler.add(seq)
        return request_id

    @property
    def grammars(self) -> Any:
        """The compiled-grammar cache for this engine's tokenizer and logits width (made on
        first use: constrained decoding needs a tokenizer)."""
        grammars = getattr(self, "_grammars", None)
        if grammars is None:
            from worker.structured import Grammars

            if self.tokenizer is None:
                raise ValueError("constrained decoding needs a tokenizer")
            config = getattr(self.model, "config", None)
            width = max(getattr(config, "vocab_size", 0) or 0, self.tokenizer.vocab_size)
            grammars = self._grammars = Grammars(self.tokenizer, width)
        return grammars

    def abort(self, request_id: str) -> bool:
        """Cancel a waiting or running request; its final output comes from the next step()."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        request.seq.drop_pending_tokens()
        self.scheduler.finish(request.seq, FinishReason.CANCELLED)
        if request.detokenizer is not None:
            request.pending_text += request.detokenizer.flush()
        self._finished_outside_step.append(self._output(request))
        return True

    def warm_up(self) -> list[str]:
        """Run one step of each kernel specialization class (`specialization_class`) the
        scheduler can form, so that Triton compiles now and not under a user's request: a class
        first seen under traffic held a whole wave of requests for 2-6 s on the H200
        (docs/performance.md). Per-step sizes (token, row and sequence counts) are not
        specialized (`_launch.PER_STEP_SIZES`); what still varies is bucketed by powers of two:
        the number of prefill chunks and of decodes in a step (up to max_num_seqs), and the row
        tile of short steps' FP8 GEMMs. No context length is warmed up: the decode attention's
        split count follows the batch, not the block table's width. Leaves the engine empty;
        returns the compositions run, as "prefills x length + decodes"."""
        c = self.config
        decoding = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        # the smallest count of each power-of-two bucket: the most compositions fit
        counts = [b // 2 + 1 for b in _buckets(c.max_num_seqs) if b // 2 + 1 <= c.max_num_seqs]
        longest = c.max_model_len - 1
        run: list[str] = []

        def compose(prefills: int, length: int, decodes: int, decode_len: int = 1) -> None:
            ids = [self.add_request([1] * decode_len, decoding) for _ in range(decodes)]
            while any(self._requests[r].seq.num_computed_tokens < decode_len for r in ids):
                self.step()  # their prompts in: from now on they decode
            ids += [self.add_request([1] * length, one) for _ in range(prefills)]
            while any(
                self._requests[r].seq.num_computed_tokens < length
                for r in ids[decodes:]
                if r in self._requests
            ):
                self.step()  # the composition (a long prompt's chunks run beside the decodes)
            for request_id in ids:
                self.abort(request_id)
            while self.has_unfinished_requests():
                self.step()
            run.append(f"{prefills}x{length}+{decodes}")

        for decodes in [0, *counts]:
            for prefills in counts:
                share = (c.max_num_batched_tokens - decodes) // prefills
                if prefills + decodes <= c.max_num_seqs and share >= 1:
                    compose(prefills, min(share, longest), decodes)
        # Steps of 17-32 and 33-64 tokens, whose FP8 GEMMs run the wide GEMV tilings: one short
        # prompt beside the decodes that fit.
        for rows in (32, 64):
            decodes = max(0, min(max(counts, default=0), rows // 2, c.max_num_seqs - 1))
            length = rows // 2 + 1 - decodes  # rows // 2 + 1 tokens: the bucket's smallest
            if rows // 2 < c.max_num_batched_tokens and length <= longest:
                compose(1, length, decodes)
        # Staged KV: one sequence past its anchors and window, decoded until its oldest recent
        # page is stale, so the re-encode kernel compiles here (on one H200 its first launch,
        # under the first wave of requests, took a 6 s step)
        if self.runner.staged_caches:
            bm = self.block_manager
            length = min((bm.anchor_pages + bm.window_pages + 1) * c.block_size, longest)
            steps = SamplingParams(temperature=0, max_tokens=bm.min_age + 2, ignore_eos=True)
            before = self.runner.restaged_pages
            self.add_request([1] * length, steps)
            while self.has_unfinished_requests():
                self.step()
            run.append(f"1x{length} restaging {self.runner.restaged_pages - before} pages")
        return run

    @property
    def admission_hold_s(self) -> float:
        """Seconds the last step held new arrivals for (prefill gathering): nothing else ran,
        so the caller may sleep that long, or until a request arrives, before stepping again."""
        return self.scheduler.admission_hold_s

    def has_unfinished_requests(self) -> bool:
        return (
            bool(self._requests) or bool(self._finished_outside_step) or self._in_flight is not None
        )

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # --- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and run one forward pass; one output per request that got a token.

        With overlapped decode the tokens of a decode step come out of the next step() call.
        A step slower than TOKENMILL_ENGINE_SLOW_STEP_S (1 s) is logged with its batch: every
        request in it waited that long (a kernel compiled for a new shape, say)."""
        began, compiled = time.perf_counter(), _compiles()
        outputs = self._step()
        took = time.perf_counter() - began
        if took > SLOW_STEP_S and self._last_batch is not None:
            b = self._last_batch
            log.warning(
                "slow engine step %d: %.2f s for %d prefill chunks (%d tokens) and %d decodes "
                "(%d kernel compiles%s)",
                b.step,
                took,
                len(b.prefills),
                sum(e.num_tokens for e in b.prefills),
                len(b.decodes),
                _compiles() - compiled,
                "".join(f"; {name}: {spec}" for name, spec in _compiled_since(compiled)),
            )
        return outputs

    def _step(self) -> list[RequestOutput]:
        outputs, self._finished_outside_step = self._finished_outside_step, []
        if self._in_flight is not None and not self._can_launch_ahead():
            self.step_kinds["drained"] += 1
            outputs += self._settle()
        # staged KV: pages that aged out move before the schedule, so its growth can reuse them
        self.runner.restage(self.block_manager, self.scheduler.running, self.scheduler.step + 1)
        batch = self._last_batch = self.scheduler.schedule()
        if batch.is_empty:
            return outputs + self._settle()
        if self._overlaps(batch):
            self.step_kinds["overlapped"] += 1
            return outputs + self._launch(batch)
        if self._in_flight is not None:  # _can_launch_ahead promised an overlapping batch
            raise RuntimeError("a step was scheduled on tokens still in flight")
        self.step_kinds["synchronous"] += 1
        try:
            self.runner.copy_states(batch.state_restores)
            next_tokens = self.runner.execute(batch)
        except Exception as exc:  # a failed step ends its sequences, not the engine
            log.exception("engine step %d failed", batch.step)
            return outputs + self._fail(batch, f"{type(exc).__name__}: {exc}")
        self.scheduler.complete(batch, next_tokens)
        self.runner.copy_states(batch.state_saves)
        for entry, token in zip(batch.entries, next_tokens, strict=True):
            if token is None:
                continue
            request = self._requests[entry.seq.request_id]
            delta = self._accept(request, token)
            outputs.append(self._output(request, delta))
        return outputs

    # --- overlapped decode ------------------------------------------------------------------

    def _overlaps(self, batch: ScheduledBatch) -> bool:
        return (
            self.overlap_decode
            and not batch.prefills
            and all(self._argmax_on_device(e.seq) for e in batch.decodes)
        )

    def _argmax_on_device(self, seq: Sequence) -> bool:
        """Whether the device's argmax is the sequence's token (overlapped decode): greedy, or
        greedy under a grammar mask when constrained sequences overlap too."""
        params = seq.params
        if params.greedy:
            return True
        return (
            self.config.overlap_constrained
            and params.temperature == 0
            and params.logprobs is None
            and seq.grammar is not None
        )

    def _can_launch_ahead(self) -> bool:
        """Whether the next schedule() gives a greedy decode-only batch of every running
        sequence on top of the in-flight tokens: nothing waits, no one can preempt, and no
        sequence is certain to stop on its in-flight token (its length limit)."""
        sched = self.scheduler
        if sched.waiting or not sched.running:
            return False
        if len(sched.running) > sched.max_num_batched_tokens:
            return False
        new_blocks = 0
        for seq in sched.running:
            if not self._argmax_on_device(seq) or seq.num_uncomputed_tokens != 1:
                return False
            if (
                seq.num_output_tokens >= seq.params.max_tokens
                or seq.num_tokens >= self.config.max_model_len
            ):
                return False
            new_blocks += self.block_manager.num_new_blocks(seq, seq.num_tokens)
        return new_blocks <= self.block_manager.num_free_blocks

    def _launch(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Launch `batch` without waiting, then settle the step before it. Constrained rows
        are re-picked under their masks once the settled tokens have advanced their grammars:
        the masks are filled while the device runs the forward."""
        constrained = [i for i, e in enumerate(batch.decodes) if e.seq.grammar is not None]
        try:
            logits = self.runner.launch_forward(batch)
            tokens = None if constrained else self.runner.launch_tokens(len(batch.decodes))
        except Exception as exc:
            log.exception("engine step %d failed", batch.step)
            return self._settle() + self._fail(batch, f"{type(exc).__name__}: {exc}")
        index = [e.seq.num_output_tokens for e in batch.decodes]
        self.scheduler.complete(batch, [PENDING_TOKEN] * len(batch.decodes))
        # tail checkpoints: queued behind the step on the device, so they copy its state
        self.runner.copy_states(batch.state_saves)
        previous, self._in_flight = self._in_flight, None
        outputs = self._settle(previous) if previous is not None else []
        if constrained:
            # a sequence the settled token finished drops this step's token: any mask will do
            rows = [i for i in constrained if not batch.decodes[i].seq.is_finished]
            try:
                if rows:
                    masks = [batch.decodes[i].seq.grammar.next_mask() for i in rows]
                    self.runner.launch_masked(logits, rows, masks)
                tokens = self.runner.launch_tokens(len(batch.decodes))
            except Exception as exc:
                log.exception("engine step %d failed", batch.step)
                return outputs + self._fail(batch, f"{type(exc).__name__}: {exc}")
        assert tokens is not None
        self._in_flight = _InFlight(batch, tokens, index)
        return outputs

    def _settle(self, in_flight: _InFlight | None = None) -> list[RequestOutput]:
        """Read back an in-flight step's tokens (default: the current one) and apply them:
        stop rules, text, outputs. Sequences that finished meanwhile drop theirs."""
        if in_flight is None:
            in_flight, self._in_flight = self._in_flight, None
            if in_flight is None:
                return []
        outputs = []
        tokens = in_flight.tokens.tolist()
        for entry, token, index in zip(
            in_flight.batch.decodes, tokens, in_flight.token_index, strict=True
        ):
            seq = entry.seq
            if seq.is_finished:  # stopped on an earlier token, or aborted
                continue
            seq.output_token_ids[index] = token
            if seq.grammar is not None and not seq.grammar.accept(token):
                log.error("sequence %d: the grammar refused its token %d", seq.seq_id, token)
            # The output as it stood when this token was sampled: a later pending token,
            # already launched, is dropped if this one stops the sequence.
            later = seq.output_token_ids[index + 1 :]
            del seq.output_token_ids[index + 1 :]
            request = self._requests[seq.request_id]
            delta = self._accept(request, token)
            if not seq.is_finished:
                seq.output_token_ids += later
            outputs.append(self._output(request, delta))
        return outputs

    def _accept(self, request: _Request, token: int) -> str:
        """Apply the stop rules to a freshly sampled token; the text it releases."""
        seq, detokenizer = request.seq, request.detokenizer
        request.new_token_ids.append(token)
        reason = stop_by_token(seq, token, self.eos_token_ids, self.config.max_model_len)
        text = ""
        if detokenizer is not None:
            if reason is not FinishReason.STOP:  # stop tokens (EOS) are not part of the text
                text = detokenizer.add([token])
                if detokenizer.stopped:
                    reason = FinishReason.STOP
            if reason is not None:
                text += detokenizer.flush()
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return text

    def _fail(self, batch: ScheduledBatch, error: str) -> list[RequestOutput]:
        outputs = []
        for entry in batch.entries:
            if entry.seq.is_finished:  # stopped by the in-flight step settled just before
                continue
            request = self._requests[entry.seq.request_id]
            entry.seq.drop_pending_tokens()
            self.scheduler.finish(entry.seq, FinishReason.ERROR)
            outputs.append(self._output(request, error=error))
        return outputs

    def _output(self, request: _Request, text: str = "", error: str | None = None) -> RequestOutput:
        seq = request.seq
        if seq.is_finished:
            del self._requests[seq.request_id]
        output = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=request.new_token_ids,
            text=request.pending_text + text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            usage=Usage(seq.num_prompt_tokens, seq.num_sampled_tokens, seq.num_cached_tokens),
            metrics=RequestMetrics(
                seq.arrival_time, seq.first_token_time, seq.finish_time, seq.num_preemptions
            ),
            error=error,
            logprobs=seq.pending_logprobs[: len(request.new_token_ids)],
        )
        if (
            seq.params.prompt_logprobs is not None
            and not request.prompt_logprobs_sent
            and len(seq.prompt_logprobs) == seq.num_prompt_tokens - 1
        ):
            output.prompt_logprobs = [None, *seq.prompt_logprobs]
            request.prompt_logprobs_sent = True
        request.new_token_ids, request.pending_text = [], ""
        seq.pending_logprobs = []
        return output

    # --- convenience ----------------------------------------------------------------------

    def generate(
        self,
        prompts: Iterable[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Serve all prompts together; one whole RequestOutput per prompt, in order."""
        prompt_list = list(prompts)
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(prompt_list)
        )
        ids = [self.add_request(p, sp) for p, sp in zip(prompt_list, params_list, strict=True)]
        results: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                acc = results.get(out.request_id)
                if acc is None:
                    results[out.request_id] = out
                    continue
                acc.new_token_ids = acc.new_token_ids + out.new_token_ids
                acc.logprobs = acc.logprobs + out.logprobs
                acc.prompt_logprobs = acc.prompt_logprobs or out.prompt_logprobs
                acc.text += out.text
                acc.finished, acc.finish_reason, acc.error = (
                    out.finished,
                    out.finish_reason,
                    out.error,
                )
                acc.usage, acc.metrics = out.usage, out.metrics
        return [results[i] for i in ids]


def _compiles() -> int:
    """Triton kernel compilations so far in this process: 0 until the kernels' registry
    imported them (a step must not pay for importing triton)."""
    launch = sys.modules.get("worker.kernels.triton._launch")
    return 0 if launch is None else launch.compiles()


def _compiled_since(count: int) -> list[tuple[str, str]]:
    launch = sys.modules.get("worker.kernels.triton._launch")
    return [] if launch is None else launch.compiled_since(count)


def _bucket(n: int) -> int:
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def _buckets(n: int) -> list[int]:
    """The power-of-two buckets of the counts 1..n."""
    return sorted({_bucket(i) for i in range(1, n + 1)})


def specialization_classes(meta: BatchMetadata) -> set[tuple[str, int, int]]:
    """The compile-time variants an eager step's kernels meet beyond the model's own shapes
    (per-step sizes are not specialized: `_launch.PER_STEP_SIZES`): ("seqs", prefill chunks,
    decodes), each bucketed by powers of two (the DeltaNet and attention kernels pad their
    sequence counts so; the decodes' bucket also sets the decode attention's split count), and
    for steps of at most 64 tokens ("gemm_rows", 16 / 32 / 64, 0): the GEMV row tile of the FP8
    decode GEMMs (from 17 rows their measured wide tilings, `fp8_gemm.WIDE_DECODE_TILINGS`)."""
    p, d = _bucket(meta.num_prefills), _bucket(meta.num_decodes)
    classes = {("seqs", p, d)}
    if meta.num_tokens <= 64:
        classes.add(("gemm_rows", max(16, _bucket(meta.num_tokens)), 0))
    return classes


def _eos_token_ids(config: EngineConfig, tokenizer: Any, model: Any) -> list[int]:
    if config.eos_token_ids is not None:
        return list(config.eos_token_ids)
    for source in (tokenizer, getattr(model, "config", None)):
        if source is None:
            continue
        for name in ("eos_token_ids", "eos_token_id"):
            value = getattr(source, name, None)
            if value is None:
                continue
            if isinstance(value, int):
                return [value]
            return [int(v) for v in value]
    return []


__all__ = [
    "ContextLengthExceeded",
    "EngineConfig",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "Usage",
]
