"""The one runner between decide and execute: ScheduledBatch -> tensors -> model -> tokens.

Decode-only steps (every entry one token on top of its cache) take a fixed-shape path: the batch
is padded to the next captured size (1, 2, 4, 8, ... max_num_seqs) in static input buffers with
block tables padded to `max_model_len / block_size` blocks, and on a GPU that step is a CUDA-graph
replay of forward + logits. Padded rows point at a scratch KV block and a scratch state slot that
the cache holds beyond what the engine hands out, so they never touch a real sequence. Prefill
and mixed steps run eagerly with exactly sized metadata.

With staged KV (`staging`), every full-attention layer holds recent pages and TurboQuant-coded
pages (worker/kvcache/): the scratch block is the recent pool's last, compressed block ids start
right after it (`first_compressed_block`), and `restage` re-encodes the pages the block manager
moved, for all layers in one batch, before the step that reads them.

Size: The one runner between decide and execute (batch tensors, CUDA graph capture and replay,
sampling); split, capture and replay would straddle modules.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from worker.engine.batch import BatchMetadata, index_on
from worker.engine.block_manager import BlockManager
from worker.engine.sampler import Sampler, token_logprobs
from worker.engine.scheduler import ScheduledBatch
from worker.engine.sequence import PENDING_TOKEN, Sequence
from worker.kernels.pdl import pdl_enabled, set_pdl
from worker.kvcache import staged as staged_kv
from worker.models.cache import KVStaging

log = logging.getLogger(__name__)

# Prompt positions whose logits are made at once for prompt logprobs: [rows, vocab] float32.
PROMPT_LOGPROBS_ROWS = 256


def model_device(model: torch.nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    for tensor in model.parameters():
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def padded_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes decode steps are padded to: powers of two, and max_num_seqs itself."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_num_seqs]


def width_bucket(blocks: int) -> int:
    """An eager step's block-table width: the next power of two of its widest sequence."""
    return 1 << max(0, blocks - 1).bit_length()


class DecodeInputs:
    """Static buffers of a padded decode step (device), filled from pinned host staging buffers.

    Row r < B is a real sequence; rows B..P-1 are padding: token 0 at position 0 with context 1,
    writing KV to the scratch block and state to the scratch slot.
    """

    def __init__(
        self,
        max_rows: int,
        max_blocks: int,
        block_size: int,
        scratch_block: int,
        scratch_slot: int,
        device: torch.device,
    ) -> None:
        self.max_rows, self.max_blocks, self.block_size = max_rows, max_blocks, block_size
        self.scratch_block, self.scratch_slot = scratch_block, scratch_slot
        pin = device.type == "cuda"
        # Two sets of pinned staging buffers, used in turn: with overlapped decode the host
        # stages step N+1 while step N's upload may still be queued behind step N-1.
        self.host_sets = [
            {
                "input_ids": torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin),
                # row of the previous decode step whose sampled token this row feeds (-1: none)
                "source_rows": torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin),
                "positions": torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin),
                "slot_mapping": torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin),
                "context_lens": torch.zeros(max_rows, dtype=torch.int32, pin_memory=pin),
                "state_slots": torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin),
                "block_tables": torch.zeros(
                    max_rows, max_blocks, dtype=torch.int32, pin_memory=pin
                ),
            }
            for _ in range(2)
        ]
        self.host = self.host_sets[0]
        self.device_buffers = {k: torch.zeros_like(v, device=device) for k, v in self.host.items()}
        # The greedy token of every row of the last padded decode step, written on the device
        # by the step itself; the next step reads its pending input ids from here.
        self.last_sampled = torch.zeros(max_rows, dtype=torch.int64, device=device)
        rows = torch.arange(max_rows + 1, dtype=torch.int32, device=device)
        self.cu_seqlens = rows  # one token per row
        self.logits_indices = rows[:max_rows].long()
        self.has_initial_state = torch.ones(max_rows, dtype=torch.bool, device=device)
        for host in self.host_sets:
            self.host = host
            self.fill_padding(0, max_rows)
        self.upload()

    def fill_padding(self, start: int, stop: int) -> None:
        h = self.host
        h["input_ids"][start:stop] = 0
        h["source_rows"][start:stop] = -1
        h["positions"][start:stop] = 0
        h["slot_mapping"][start:stop] = self.scratch_block * self.block_size
        h["context_lens"][start:stop] = 1
        h["state_slots"][start:stop] = self.scratch_slot
        h["block_tables"][start:stop] = self.scratch_block

    def fill(
        self, batch: ScheduledBatch, rows: int, sampled_rows: dict[int, int] | None = None
    ) -> None:
        """Stage the decodes of `batch` in rows [0, B) and padding in [B, rows): one host tensor
        per field group, in the staging set not used by the previous step. A pending token
        (sampled by the previous decode step, not yet read back) is fed from that step's row
        `sampled_rows[seq_id]` of `last_sampled`, on the device."""
        self.host = h = self.host_sets[1] if self.host is self.host_sets[0] else self.host_sets[0]
        fields: list[list[int]] = [[], [], [], [], [], []]  # ids, sources, positions, slots,
        tables: list[list[int]] = []  # lens, states
        for e in batch.decodes:
            seq, pos = e.seq, e.start
            table = seq.block_table
            if len(table) > self.max_blocks:
                raise RuntimeError(f"sequence {seq.seq_id} outgrew max_model_len")
            token = seq.token_ids(pos, pos + 1)[0]
            source = -1
            if token == PENDING_TOKEN:
                if sampled_rows is None or seq.seq_id not in sampled_rows:
                    raise RuntimeError(f"sequence {seq.seq_id} feeds a token no step sampled")
                token, source = 0, sampled_rows[seq.seq_id]
            fields[0].append(token)
            fields[1].append(source)
            fields[2].append(pos)
            fields[3].append(
                table[pos // self.block_size] * self.block_size + pos % self.block_size
            )
            fields[4].append(pos + 1)
            if seq.state_slot is None:
                raise RuntimeError("a scheduled sequence holds no state slot")
            fields[5].append(seq.state_slot)
            tables.append(table)
        b = len(tables)
        if b:
            values = torch.tensor(fields, dtype=torch.int64)
            for name, row in zip(
                (
                    "input_ids",
                    "source_rows",
                    "positions",
                    "slot_mapping",
                    "context_lens",
                    "state_slots",
                ),
                values,
                strict=True,
            ):
                h[name][:b] = row
            # row by row through numpy: a list into an array view converts in C, where
            # torch.tensor of the padded lists took 3.6 ms for 32 tables of 2,048 pages
            width = max(len(t) for t in tables)
            block_tables = h["block_tables"].numpy()
            for i, table in enumerate(tables):
                block_tables[i, : len(table)] = table
                block_tables[i, len(table) : width] = self.scratch_block
        self.fill_padding(b, rows)
        self.upload(rows)

    def upload(self, rows: int | None = None) -> None:
        rows = self.max_rows if rows is None else rows
        for name, host in self.host.items():
            self.device_buffers[name][:rows].copy_(host[:rows], non_blocking=True)

    def input_ids(self, rows: int) -> torch.Tensor:
        """The step's input ids: staged ids, or the previous step's sampled token (on device)."""
        staged = self.device_buffers["input_ids"][:rows]
        sources = self.device_buffers["source_rows"][:rows]
        fed = self.last_sampled.index_select(0, sources.clamp(min=0))
        return torch.where(sources >= 0, fed, staged)

    def meta(self, rows: int) -> BatchMetadata:
        d = self.device_buffers
        return BatchMetadata(
            seq_ids=list(range(rows)),
            num_prefills=0,
            query_lens=[1] * rows,
            context_lens=d["context_lens"][:rows],
            cu_seqlens=self.cu_seqlens[: rows + 1],
            positions=d["positions"][:rows],
            slot_mapping=d["slot_mapping"][:rows],
            block_tables=d["block_tables"][:rows],
            state_slots=d["state_slots"][:rows],
            has_initial_state=self.has_initial_state[:rows],
            logits_indices=self.logits_indices[:rows],
        )


class SampledTokens:
    """The greedy tokens of a launched decode step, on their way to pinned host memory."""

    def __init__(self, host: torch.Tensor, count: int, event: torch.cuda.Event | None) -> None:
        self.host, self.count, self.event = host, count, event

    def tolist(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host[: self.count].tolist()


class ModelRunner:
    """Owns the model's cache; runs one scheduled batch per call and returns sampled tokens.

    The cache holds `num_blocks + 1` KV blocks and `num_state_slots + 1` state slots: the last
    of each is scratch for padded decode rows. `pad_decode` (needs `max_model_len`) sends
    decode-only steps through the padded static buffers; `cuda_graphs` (CUDA only, implies
    padding) captures them, one graph per padded size, sharing one memory pool.
    """

    def __init__(
        self,
        model: Any,
        num_blocks: int,
        block_size: int,
        num_state_slots: int,
        kv_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        max_model_len: int | None = None,
        state_dtype: torch.dtype | None = None,
        cuda_graphs: bool = False,
        pad_decode: bool | None = None,
        staging: KVStaging | None = None,
        num_checkpoint_slots: int = 0,
    ) -> None:
        self.model = model
        self.device = torch.device(device) if device is not None else model_device(model)
        self.block_size = block_size
        self.kv_dtype = kv_dtype or model_dtype(model)
        self.state_dtype = state_dtype or model_dtype(model)
        self.staging = staging
        self.cache = model.allocate_cache(
            num_blocks + 1,
            block_size,
            num_state_slots + 1 + num_checkpoint_slots,
            self.kv_dtype,
            self.device,
            state_dtype=self.state_dtype,
            **({} if staging is None else {"staging": staging}),
        )
        # prefix caching's state checkpoints: the slots past the scratch slot
        self.first_checkpoint_slot = num_state_slots + 1
        self.num_checkpoint_slots = num_checkpoint_slots
        # a cache without recurrent state (dense) resumes a prefix from KV alone; one whose state
        # cannot be copied (a test double without `copy_state_slots`) never resumes one
        self.has_state = bool(getattr(self.cache, "has_recurrent_state", True))
        self.can_copy_state = hasattr(self.cache, "copy_state_slots")
        # block ids past the recent pool (scratch included) name compressed pages
        self.first_compressed_block = num_blocks + 1
        # a cache without staged layers (or a test double without `staged`): restage is a no-op
        self.staged_caches = self.cache.staged() if staging is not None else []
        self.restaged_pages = 0  # pages re-encoded so far (all layers count once)
        self.sampler = Sampler()
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        pad = self.cuda_graphs if pad_decode is None else (pad_decode or self.cuda_graphs)
        self.decode_inputs: DecodeInputs | None = None
        self.sizes = padded_sizes(num_state_slots)
        if pad and max_model_len is not None:
            self.decode_inputs = DecodeInputs(
                self.sizes[-1],
                -(-max_model_len // block_size),
                block_size,
                scratch_block=num_blocks,
                scratch_slot=num_state_slots,
                device=self.device,
            )
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_error: str | None = None  # why capture failed (decode then runs eagerly)
        # seq_id -> row of the last padded decode step (where its token is in `last_sampled`)
        self.sampled_rows: dict[int, int] = {}
        pin = self.device.type == "cuda"
        self._token_buffers = [
            torch.zeros(self.sizes[-1], dtype=torch.int64, pin_memory=pin) for _ in range(2)
        ]
        self._last_buffer = 1

    @torch.inference_mode()
    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy DeltaNet state slots (source, destination), in stream order with the steps."""
        if pairs:
            self.cache.copy_state_slots(pairs)

    # --- staged KV --------------------------------------------------------------------------

    @torch.inference_mode()
    def restage(
        self, block_manager: BlockManager, seqs: list[Sequence], step: int
    ) -> list[tuple[int, int]]:
        """Ask the block manager which recent pages of `seqs` went stale at `step` (it moves
        them to compressed blocks) and re-encode them in every staged layer, one launch per
        layer; call before `step` is scheduled so its growth may reuse the freed pages (their
        new writes run after the re-encode, in stream order). The moves made, if any."""
        if not self.staged_caches:
            return []
        moves = block_manager.restage(seqs, step)
        staged_kv.restage(self.staged_caches, moves, self.device)
        self.restaged_pages += len(moves)
        return moves

    # --- eager steps ----------------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, BatchMetadata]:
        """Input token ids [T] and the step's metadata, on the model's device."""
        entries = batch.entries
        query_lens = [e.num_tokens for e in entries]
        input_ids: list[int] = []
        for e in entries:
            input_ids.extend(e.seq.token_ids(e.start, e.end))
        starts = torch.tensor([e.start for e in entries], dtype=torch.int64)
        lens = torch.tensor(query_lens, dtype=torch.int64)
        cu_seqlens = torch.zeros(len(entries) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.cumsum(lens, 0)

        # Position of every fed token: its sequence's start plus its offset within the chunk.
        seq_of_token = torch.repeat_interleave(torch.arange(len(entries)), lens)
        offset_in_chunk = torch.arange(int(lens.sum())) - cu_seqlens[:-1].long()[seq_of_token]
        positions = starts[seq_of_token] + offset_in_chunk

        # The table's width sets the attention kernels' split sizes (compile-time constants):
        # rounding it up to a power of two bounds the variants an eager step can meet to the
        # ones `LLMEngine.warm_up` runs. Entries past a sequence's blocks are never read.
        max_blocks = width_bucket(max(len(e.seq.block_table) for e in entries))
        block_tables = torch.zeros(len(entries), max_blocks, dtype=torch.int32)
        for i, e in enumerate(entries):
            block_tables[i, : len(e.seq.block_table)] = torch.tensor(e.seq.block_table)
        blocks = block_tables[seq_of_token, positions // self.block_size].long()
        slot_mapping = blocks * self.block_size + positions % self.block_size

        state_slots = [e.seq.state_slot for e in entries]
        if any(s is None for s in state_slots):
            raise RuntimeError("a scheduled sequence holds no state slot")

        def on_device(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.device, non_blocking=True)

        meta = BatchMetadata(
            seq_ids=[e.seq.seq_id for e in entries],
            num_prefills=len(batch.prefills),
            query_lens=query_lens,
            context_lens=on_device(torch.tensor([e.end for e in entries], dtype=torch.int32)),
            cu_seqlens=on_device(cu_seqlens),
            positions=on_device(positions),
            slot_mapping=on_device(slot_mapping),
            block_tables=on_device(block_tables),
            state_slots=on_device(torch.tensor(state_slots, dtype=torch.int64)),
            has_initial_state=on_device(torch.tensor([e.start > 0 for e in entries])),
            logits_indices=on_device(cu_seqlens[1:].long() - 1),
        )
        return on_device(torch.tensor(input_ids, dtype=torch.int64)), meta

    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        return self.model.forward(input_ids, meta, self.cache)

    def _logits(self, input_ids: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        """Float32 logits of every sequence's last fed token."""
        hidden = self.forward(input_ids, meta)
        return self.model.compute_logits(hidden[meta.logits_indices])

    def _record_prompt_logprobs(self, hidden: torch.Tensor, batch: ScheduledBatch) -> None:
        """Appends to `seq.prompt_logprobs` the logprob of each prompt token this step's chunk
        predicts (position j predicts token j + 1), for the sequences that ask; a chunk fed
        again after preemption adds nothing already recorded."""
        row = 0
        for e in batch.entries:
            seq, k = e.seq, e.seq.params.prompt_logprobs
            first = max(e.start, len(seq.prompt_logprobs))
            last = min(e.end, seq.num_prompt_tokens - 1)
            if k is not None and first < last:
                targets = seq.prompt_token_ids[first + 1 : last + 1]
                states = hidden[row + first - e.start : row + last - e.start]
                for at in range(0, len(targets), PROMPT_LOGPROBS_ROWS):  # bounded logits
                    part = targets[at : at + PROMPT_LOGPROBS_ROWS]
                    logits = self.model.compute_logits(states[at : at + len(part)])
                    seq.prompt_logprobs += token_logprobs(logits, part, k)
            row += e.num_tokens

    # --- padded decode steps --------------------------------------------------------------

    def padded_size(self, num_decodes: int) -> int:
        return next(s for s in self.sizes if s >= num_decodes)

    def _decode_step(self, rows: int) -> torch.Tensor:
        """Forward + logits of the staged padded step, and its greedy tokens into
        `last_sampled` (what CUDA graphs capture)."""
        inputs = self.decode_inputs
        assert inputs is not None
        logits = self._logits(inputs.input_ids(rows), inputs.meta(rows))
        inputs.last_sampled[:rows].copy_(torch.argmax(logits, dim=-1))
        return logits

    def _run_decode(self, batch: ScheduledBatch) -> torch.Tensor:
        """Stage and run a decode-only batch through the padded buffers (graph or eager)."""
        assert self.decode_inputs is not None
        rows = self.padded_size(len(batch.decodes))
        self.decode_inputs.fill(batch, rows, self.sampled_rows)
        self.sampled_rows = {e.seq.seq_id: row for row, e in enumerate(batch.decodes)}
        graph = self.graphs.get(rows)
        if graph is not None:
            graph[0].replay()
            return graph[1][: len(batch.decodes)]
        return self._decode_step(rows)[: len(batch.decodes)]

    def decode_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only batch through the padded buffers (graph or eager)."""
        return self._run_decode(batch)

    @torch.inference_mode()
    def launch_forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """Start a greedy decode-only step without waiting for it: forward, logits and greedy
        tokens, queued; its logits [B, vocab] (the graph's own buffer). Its tokens stay on the
        device (the next step feeds them itself) and come back to the host through
        `launch_tokens`, read by `SampledTokens.tolist()` once the host needs them."""
        assert self.decode_inputs is not None
        return self._run_decode(batch)

    @torch.inference_mode()
    def launch_masked(
        self, logits: torch.Tensor, rows: list[int], masks: list[torch.Tensor]
    ) -> None:
        """Re-pick the greedy token of `rows` of a launched step under their grammar masks
        (same order), queued behind its forward: what the next step feeds and reads back."""
        from worker.structured.grammar import apply_masks

        assert self.decode_inputs is not None
        index = index_on(logits.device, rows)
        apply_masks(logits, rows, masks, index)
        picked = torch.argmax(logits.index_select(0, index), dim=-1)
        self.decode_inputs.last_sampled.index_copy_(0, index, picked)

    def launch_tokens(self, n: int) -> SampledTokens:
        """The last launched step's n tokens, on their way to pinned host memory."""
        assert self.decode_inputs is not None
        host = self._token_buffers[0] if self._last_buffer == 1 else self._token_buffers[1]
        self._last_buffer = 0 if self._last_buffer == 1 else 1
        host[:n].copy_(self.decode_inputs.last_sampled[:n], non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return SampledTokens(host, n, event)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture forward + logits for every padded size (largest first, one shared pool).

        Each size runs eagerly once first (kernel compilation and lazy init stay outside the
        capture). All rows are padding during capture, so only scratch memory is written. A
        failure leaves decode eager and records why in `graph_error`.
        """
        if not self.cuda_graphs or self.decode_inputs is None or self.graphs:
            return
        inputs = self.decode_inputs
        inputs.fill_padding(0, inputs.max_rows)
        inputs.upload()
        pool = torch.cuda.graph_pool_handle()
        try:
            for rows in reversed(self.sizes):
                self._decode_step(rows)  # warm: compile kernels, allocate lazily held buffers
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._decode_step(rows)
                self.graphs[rows] = (graph, logits)
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # eager decode still works; say why graphs are off
            self.graphs.clear()
            self.graph_error = f"{type(exc).__name__}: {exc}"
            if pdl_enabled(self.device):  # a driver that cannot capture PDL edges: without
                log.warning("CUDA graph capture failed with PDL launches; retrying without")
                set_pdl(False)
                self.graph_error = None
                self.capture_graphs()
                if self.graph_error is None:
                    self.graph_error = f"captured without PDL ({type(exc).__name__}: {exc})"
                return
            log.exception("CUDA graph capture failed; decode runs eagerly")

    # --- one step -------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        """Run one step; the next token of every entry that samples, None for the others."""
        entries = batch.entries
        if self.decode_inputs is not None and not batch.prefills:
            logits = self.decode_logits(batch)
            sampled = self.sampler(logits, [e.seq for e in batch.decodes])
            return list(sampled)
        self.sampled_rows = {}  # an eager step writes no `last_sampled`
        input_ids, meta = self.prepare(batch)
        rows = [i for i, e in enumerate(entries) if e.samples]
        next_tokens: list[int | None] = [None] * len(entries)
        hidden = self.forward(input_ids, meta)
        if any(e.seq.params.prompt_logprobs is not None for e in batch.prefills):
            self._record_prompt_logprobs(hidden, batch)
        if not rows:  # only prefill chunks that do not reach their sequence's end
            return next_tokens
        row_index = torch.tensor(rows, device=self.device)
        logits = self.model.compute_logits(hidden[meta.logits_indices[row_index]])
        sampled = self.sampler(logits, [entries[i].seq for i in rows])
        for i, token in zip(rows, sampled, strict=True):
            next_tokens[i] = token
        return next_tokens
