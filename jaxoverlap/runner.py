"""The model runner: turns a ScheduledBatch into padded host arrays and launches a jitted step.

`launch` must never wait for the device: it only builds small numpy arrays, calls the
jitted step (which returns at once under JAX's async dispatch) and starts the copy of the
step's small outputs to the host. Tests run it under
`jax.transfer_guard_device_to_host("disallow")`.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jaxoverlap import steps
from jaxoverlap.buckets import next_power_of_two, pick, powers_of_two_up_to
from jaxoverlap.device_state import DeviceState
from jaxoverlap.models.config import ModelConfig
from jaxoverlap.models.params import ModelParams
from jaxoverlap.scheduler import ScheduledBatch


@dataclasses.dataclass
class LaunchedStep:
    batch: ScheduledBatch
    out: steps.StepOutput  # device arrays; their copy to the host has been started

    def fetch(self) -> tuple[np.ndarray, np.ndarray]:
        """Wait for this step's small outputs (the only place the host waits for the device)."""
        return np.asarray(self.out.tokens), np.asarray(self.out.logprobs)


class ModelRunner:
    def __init__(
        self,
        params: ModelParams,
        model_cfg: ModelConfig,
        state: DeviceState,
        *,
        page_size: int,
        max_running: int,
        max_prefill_requests: int,
        chunked_prefill_size: int,
        table_width: int,
        batch_buckets: tuple[int, ...] | None = None,
        attention=None,
    ):
        self.params = params
        self.model_cfg = model_cfg
        self.state = state
        self.page_size = page_size
        self.table_width = table_width
        self.attention = attention or steps.xla_paged_attention
        self.batch_buckets = tuple(sorted(batch_buckets)) if batch_buckets else powers_of_two_up_to(max_running)
        if self.batch_buckets[-1] < max_running:
            self.batch_buckets += (max_running,)
        self.prefill_row_buckets = powers_of_two_up_to(max_prefill_requests)
        self.prefill_len_buckets = powers_of_two_up_to(chunked_prefill_size, start=min(16, chunked_prefill_size))
        self.ctx_buckets = powers_of_two_up_to(table_width, start=min(table_width, max(64, page_size)))
        # A decode step reserves at most this many pages per row (two windows of one token
        # plus rounding), so its reservation arrays have a fixed size per batch bucket.
        self.decode_pages_per_row = -(-2 // page_size) + 1

    # -- array building ---------------------------------------------------------------------
    def _reservations(self, batch: ScheduledBatch, capacity: int) -> steps.Reservations:
        n = len(batch.reservations)
        assert n <= capacity, f"{n} reservations exceed the capacity {capacity}"
        arr = np.zeros((3, capacity), np.int32)  # padded with (entry 0, block 0, page 0)
        if n:
            arr[:, :n] = np.asarray(batch.reservations, np.int32).T
        return steps.Reservations(entries=arr[0], page_index=arr[1], pages=arr[2])

    def _ctx_len(self, batch: ScheduledBatch) -> int:
        return pick(self.ctx_buckets, min(batch.ctx_len, self.table_width))

    # -- launch -----------------------------------------------------------------------------
    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        if batch.kind == "prefill":
            out = self._launch_prefill(batch)
        else:
            out = self._launch_decode(batch)
        # Start the copy now so that the host's later wait is for the step, not the copy.
        out.tokens.copy_to_host_async()
        out.logprobs.copy_to_host_async()
        return LaunchedStep(batch, out)

    def _launch_decode(self, batch: ScheduledBatch) -> steps.StepOutput:
        B = pick(self.batch_buckets, batch.size)
        entries = np.zeros((B,), np.int32)  # padded rows on entry 0
        entries[: batch.size] = [row.req.entry for row in batch.rows]
        res = self._reservations(batch, max(8, B * self.decode_pages_per_row))
        self.state, out = steps.decode_step(
            self.params, self.state, entries, res,
            cfg=self.model_cfg, ctx_len=self._ctx_len(batch), page_size=self.page_size, attention=self.attention,
        )
        return out

    def _launch_prefill(self, batch: ScheduledBatch) -> steps.StepOutput:
        R = pick(self.prefill_row_buckets, batch.size)
        Q = pick(self.prefill_len_buckets, max(row.length for row in batch.rows))
        tokens = np.zeros((R, Q), np.int32)
        starts = np.zeros((R,), np.int32)
        lens = np.zeros((R,), np.int32)
        entries = np.zeros((R,), np.int32)
        temperature = np.zeros((R,), np.float32)
        top_k = np.zeros((R,), np.int32)
        top_p = np.ones((R,), np.float32)
        min_p = np.zeros((R,), np.float32)
        seed = np.zeros((R,), np.uint32)
        for i, row in enumerate(batch.rows):
            req, p = row.req, row.req.params
            tokens[i, : row.length] = req.fill_ids[row.start : row.start + row.length]
            starts[i], lens[i], entries[i] = row.start, row.length, req.entry
            temperature[i], top_k[i], top_p[i], min_p[i], seed[i] = p.temperature, p.top_k, p.top_p, p.min_p, req.seed
        inp = steps.PrefillInputs(tokens, starts, lens, entries, temperature, top_k, top_p, min_p, seed)
        res = self._reservations(batch, next_power_of_two(len(batch.reservations), minimum=8))
        self.state, out = steps.prefill_step(
            self.params, self.state, inp, res,
            cfg=self.model_cfg, ctx_len=self._ctx_len(batch), page_size=self.page_size, attention=self.attention,
        )
        return out
