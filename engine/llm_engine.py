"""The synchronous engine: requests in, one `step()` at a time, increments of text out.

`AsyncEngine` runs `step()` in its own thread; `moecache generate` and the benchmarks call it directly.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from engine.arch import get_arch
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.detok import TextOutput
from engine.expert_cache.cache import ExpertCache, build_expert_cache
from engine.expert_cache.dispatch import StepTicket
from engine.expert_cache.record import StepRecord
from engine.expert_cache.store import ExpertStore
from engine.gguf.reader import GGUFFile
from engine.gguf.tokenizer import Tokenizer
from engine.kv_cache import KVCache, check_kv_fits, check_kv_types
from engine.layer_split import LayerSplit, split_layers, spread_devices
from engine.model import Model, SeqSpan
from engine.moe import Router
from engine.runner import ModelRunner
from engine.sampler import SamplingState, make_generator, on_device, prompt_logprobs, sample, sample_on_device
from engine.scheduler import Scheduler, Sequence
from engine.trace import RequestTraces
from engine.types import Request, RequestError, RequestOutput, ScheduledSeq, SchedulerOutput, StepOutput, TokenLogprob
from engine.weights import load_weights

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_devices(config: ModelConfig, model_bytes: int) -> tuple[torch.device, ...]:
    """The engine's devices (the one place that chooses them): those of --devices, else the one of --device; where
    neither is named and several GPUs are visible, `spread_devices` of the model's bytes and their free memory."""
    if config.devices is None and config.device == "auto" and torch.cuda.device_count() > 1:
        free = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
        return tuple(torch.device(name) for name in spread_devices(model_bytes, free))
    return tuple(resolve_device(name) for name in config.device_names)


def split_layers_across(config: ModelConfig, devices: tuple[torch.device, ...], gguf: GGUFFile) -> LayerSplit | None:
    """The model's layers in ranges on several devices: in proportion to --tensor-split, else to each GPU's free
    memory (CPUs: evenly); None for one device."""
    if len(devices) == 1:
        return None
    num_layers = get_arch(gguf.architecture).hparams(gguf.metadata, vocab_size=0).num_layers
    shares = config.split_shares or tuple(float(torch.cuda.mem_get_info(d)[0]) if d.type == "cuda" else 1.0
                                          for d in devices)
    return LayerSplit(tuple(str(d) for d in devices), split_layers(num_layers, shares), num_layers)


def join_streams(devices: tuple[torch.device, ...]) -> None:
    """CUDA: the last device's stream waits for every other device's (the step's work and its record's copy there),
    so that an event recorded on it, or a sync of it, covers the whole step."""
    last = torch.cuda.current_stream(devices[-1])
    for device in devices[:-1]:
        last.wait_stream(torch.cuda.current_stream(device))


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


@dataclass
class RequestState:
    """What the engine keeps of a running request beside the scheduler's `Sequence`: how it samples, its
    text, and its prompt's log-probabilities until they are sent."""

    sampling: SamplingState
    text: TextOutput
    prompt_logprobs: list[TokenLogprob] | None = None  # gathered while the prompt prefills; None once sent

    def take_prompt_logprobs(self) -> tuple[TokenLogprob | None, ...]:
        """The prompt's log-probabilities (None first: nothing precedes the first token), once."""
        if self.prompt_logprobs is None:
            return ()
        taken, self.prompt_logprobs = (None, *self.prompt_logprobs), None
        return taken


@dataclass
class _Launched:
    """A step launched and not yet read (`LLMEngine._read`)."""

    sched: SchedulerOutput
    ids: list[str]  # the requests that sample, in the order of their rows
    logits: torch.Tensor
    logits_from: list[int] | None
    ticket: StepTicket  # its record, for the cache
    start: float
    tokens: torch.Tensor | None = None  # sampled on the device: `[rows]` int64 there (a step ahead's inputs)
    host_tokens: torch.Tensor | None = None  # their copy in host memory (pinned on CUDA)
    done: torch.cuda.Event | None = None  # recorded after everything the step launched (CUDA)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    steps: int
    prompt_tokens: int
    generation_tokens: int
    decode_tokens_per_second: float  # over the last decode steps


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: Callable[[str, int, int], None] | None = None) -> None:
        if config.model.path is None:
            raise ValueError("no model file: ModelConfig.path is None (the command line picks the default model)")
        self.config = config
        self.gguf = GGUFFile(config.model.path)
        self.tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
        if config.model.kv_types != ("bf16", "bf16"):  # a type the model's layout refuses, before the weights load
            check_kv_types(get_arch(self.gguf.architecture).hparams(self.gguf.metadata, vocab_size=0),
                           *config.model.kv_types)
        self.devices = resolve_devices(config.model, sum(t.num_bytes for t in self.gguf))
        self.device = self.devices[0]  # the first device (the embedding's; a split model's last has the logits)
        self.split = split_layers_across(config.model, self.devices, self.gguf)
        if self.split is not None:
            log.info("layers split across devices: %s", self.split.describe())
        dtype = resolve_dtype(config.model.dtype, self.device)
        dense = config.model.dense_weights
        keep_q8 = "all" if dense == "q8_0" else "output" if dense == "auto" and self.device.type == "cuda" else "none"
        self.weights = load_weights(self.gguf, self.device, dtype, _bytes_progress(progress, self.gguf), keep_q8,
                                    self.split)
        hp = self.weights.hparams
        max_len = min(config.model.max_context, hp.context_length)
        sched = replace(config.scheduler, max_model_len=max_len)
        # one slot per sequence, plus a scratch slot for the padding rows of captured batches
        for layers, device in self._stages():
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
            check_kv_fits(hp, sched.max_num_seqs, max_len, dtype, config.model.kv_types, free,
                          *((layers, str(device)) if self.split is not None else ()))
        self.kv = KVCache.for_model(hp, sched.max_num_seqs + 1, max_len, dtype, self.device, *config.model.kv_types,
                                    stages=self._stages() if self.split is not None else None)
        self.store = ExpertStore(self.weights, self.device, release=self.gguf.release_pages, locate=self.gguf.locate)
        self.scheduler = Scheduler(sched)
        self.cache: ExpertCache = self._build_cache(config.cache)
        self.launches_async = self._launches_async()
        self.model = Model(self.weights, self.cache.dispatcher, split=self.split)
        self.runner = self._make_runner()
        self.states: dict[str, RequestState] = {}  # the scheduler's requests, by id
        self.traces = RequestTraces(hp.num_experts, tuple(self.weights.moe_layers), hp.top_k) \
            if config.cache.record_trace else None
        self.counters = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0}
        self._decode_rate = 0.0
        self.decodes_ahead = self._decodes_ahead()
        self._ahead: _Launched | None = None  # a decode step launched before the last one was read
        self._read_at = 0.0  # when the last step was read
        pin = self.device.type == "cuda"
        self._host_tokens = torch.zeros((2, sched.max_num_seqs), dtype=torch.int64, pin_memory=pin)  # used in turn
        self._turn = 0

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def _stages(self) -> list[tuple[range, torch.device]]:
        """Each device's range of layers (one device: all of them)."""
        if self.split is None:
            return [(range(self.weights.hparams.num_layers), self.device)]
        return list(zip(self.split.ranges, self.devices, strict=True))

    # -- requests ---------------------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        n, limit = len(request.prompt_ids), self.max_model_len
        if n == 0:
            raise RequestError("the prompt is empty", param="prompt")
        if n + request.params.max_tokens > limit:
            raise RequestError(
                f"this model's maximum context length is {limit} tokens; the prompt has {n} tokens and "
                f"max_tokens is {request.params.max_tokens} ({n + request.params.max_tokens} in all)",
                param="max_tokens", code="context_length_exceeded")
        if max(request.prompt_ids) >= self.weights.hparams.vocab_size or min(request.prompt_ids) < 0:
            raise RequestError("prompt token id out of the vocabulary", param="prompt")

    def add_request(self, request: Request) -> None:
        self.validate(request)
        params = request.params
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.tokenizer.stop_token_ids
        seq = self.scheduler.add(request, frozenset(stop_ids))  # a running request's id is refused here
        generator = make_generator(params.seed, self.devices[-1])  # where the logits are
        sampling = SamplingState(params, request.prompt_ids, seq.output_ids, generator)
        text = TextOutput(self.tokenizer, params.stop, request.prompt_ids)
        self.states[request.request_id] = RequestState(sampling, text,
                                                       None if params.prompt_logprobs is None else [])

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        output = self._output(seq, (), (), "abort")
        self._drop_dead_ahead()
        return output

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------------
    def step(self, on_launched: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One step's outputs; `on_launched` is called once device work is launched (before it is waited for).

        Decode ahead (`decodes_ahead`): where a decode step's tokens are sampled on the device and the next step
        can only be the same sequences' decode (`Scheduler.can_schedule_ahead`), that next step is launched, fed
        those tokens on the device, before this one's reach the host: the host's reading, text and scheduling of
        one step run while the device computes the next, and the device does not wait between them. A sequence
        that this step ends (a stop token or string) has its row of the step ahead dropped."""
        if self._ahead is None:
            sched = self.scheduler.schedule()  # 1. which sequences, which tokens; which ended since the last step
            self._release(sched)
            if sched.is_empty:
                self.cache.flush()
                return []
            launched = self._launch(sched, on_launched)  # 2. forward + sampling launched on the device
            on_launched = None
        else:
            launched, self._ahead = self._ahead, None
        if self._goes_ahead(launched):
            sched = self.scheduler.schedule_ahead()
            self._release(sched)
            if not sched.is_empty:
                self._ahead = self._launch(sched, on_launched, feed=launched)
        outputs = self.update(launched.sched, self._read(launched))  # 3. tokens -> text; stops applied
        self._drop_dead_ahead()
        if not self.has_unfinished():
            self.cache.flush()  # idle: the cache's stats include the last step
        return outputs

    def _drop_dead_ahead(self) -> None:
        """A step ahead every sequence of which has ended (or was aborted) is read and dropped: none is left launched
        while idle."""
        if self._ahead is not None and not any(i in self.states for i in self._ahead.ids):
            self._read(self._ahead)
            self._ahead = None

    def _release(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_ids:  # the router forgets the ended requests
            self.model.router.release(request_id)

    def _goes_ahead(self, launched: _Launched) -> bool:
        return self.decodes_ahead and launched.tokens is not None and self.scheduler.can_schedule_ahead()

    def _launch(self, sched: SchedulerOutput, on_launched: Callable[[], None] | None = None,
                feed: _Launched | None = None) -> _Launched:
        """Launch a step's forward and, where the device samples its rows (`sampler.on_device`), its sampling and the
        tokens' copy to the host. `feed`: the step launched before, whose sampled tokens are this one's inputs."""
        start = time.perf_counter()
        spans = [SeqSpan(s.slot, s.start, len(s.token_ids)) for s in sched.seqs]
        keys = [s.request_id for s in sched.seqs for _ in s.token_ids]
        logits_from = self._logits_from(sched)
        rows = [i for i, s in enumerate(sched.seqs) if s.samples]
        ids = [sched.seqs[i].request_id for i in rows]
        if feed is None:
            token_ids, fed = [list(s.token_ids) for s in sched.seqs], None
        else:
            row_of = {request_id: row for row, request_id in enumerate(feed.ids)}
            token_ids, fed = [[row_of[s.request_id]] for s in sched.seqs], feed.tokens
        logits, ticket = self._launch_forward(spans, token_ids, keys, logits_from, on_launched, fed)
        launched = _Launched(sched, ids, logits, logits_from, ticket, start)
        states = [self.states[i].sampling for i in ids]
        if rows and logits_from is None and len(rows) == len(sched.seqs) and on_device(states):
            launched.tokens = sample_on_device(logits, states)
            self._turn ^= 1
            launched.host_tokens = self._host_tokens[self._turn, :len(rows)]
            launched.host_tokens.copy_(launched.tokens, non_blocking=True)
        if self.device.type == "cuda":
            launched.done = torch.cuda.Event()
            # after the step, its record's copy and its tokens' copy (`join_streams`: on every device)
            launched.done.record(torch.cuda.current_stream(self.devices[-1]))
        return launched

    def _read(self, launched: _Launched) -> StepOutput:
        """Wait for a launched step and read it: its sampled tokens (sampled now where the device did not), its
        prompt log-probabilities, its record."""
        sched, logits = launched.sched, launched.logits
        if launched.done is not None:
            launched.done.synchronize()
        prompt: dict[str, tuple[TokenLogprob, ...]] = {}
        tokens: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        if launched.host_tokens is not None:
            tokens = launched.host_tokens.tolist()
        else:
            # NOTE: a sequence's logit rows end at its last token; one row each unless logits_from says more
            counts = [1] * len(sched.seqs) if launched.logits_from is None else \
                [s.start + len(s.token_ids) - first for s, first in zip(sched.seqs, launched.logits_from, strict=True)]
            last_rows = list(itertools.accumulate(counts, initial=-1))[1:]
            rows = [i for i, s in enumerate(sched.seqs) if s.samples]
            if rows:  # NOTE: every row of a decode step: the logits as they are, no row list to the device
                every = launched.logits_from is None and len(rows) == len(sched.seqs)
                picked = logits if every else logits[[last_rows[i] for i in rows]]
                tokens, logprobs = sample(picked, [self.states[i].sampling for i in launched.ids])
            if launched.logits_from is not None:
                prompt = self._prompt_logprobs(sched, logits, last_rows)
        record = self.cache.step_done(launched.ticket)
        if self.traces is not None:
            self.traces.add_step([(s.request_id, len(s.token_ids)) for s in sched.seqs], record.ids)
        self.counters["steps"] += 1
        now = time.perf_counter()
        seconds, self._read_at = now - max(launched.start, self._read_at), now  # a step ahead: since the last read
        return StepOutput(dict(zip(launched.ids, tokens)),
                          {i: lp for i, lp in zip(launched.ids, logprobs) if lp is not None},
                          sched.num_tokens, seconds, prompt)

    def _predicts_prompt(self, s: ScheduledSeq) -> bool:
        """Whether the chunk predicts prompt tokens whose log-probabilities the request asked for."""
        request = self.scheduler.requests[s.request_id].request
        return request.params.prompt_logprobs is not None and s.start < len(request.prompt_ids) - 1

    def _logits_from(self, sched: SchedulerOutput) -> list[int] | None:
        """First position of each sequence whose logits the step computes: all of a chunk that predicts
        asked-for prompt tokens, else the last token; None when only last tokens are needed."""
        wanted = [self._predicts_prompt(s) for s in sched.seqs]
        if not any(wanted):
            return None
        return [s.start if w else s.start + len(s.token_ids) - 1 for s, w in zip(sched.seqs, wanted, strict=True)]

    def _prompt_logprobs(self, sched: SchedulerOutput, logits: torch.Tensor,
                         last_rows: list[int]) -> dict[str, tuple[TokenLogprob, ...]]:
        out = {}
        for s, last in zip(sched.seqs, last_rows, strict=True):
            if not self._predicts_prompt(s):
                continue
            request = self.scheduler.requests[s.request_id].request
            first_row = last - len(s.token_ids) + 1
            stop = min(s.start + len(s.token_ids), len(request.prompt_ids) - 1)  # positions before predict
            next_ids = request.prompt_ids[s.start + 1:stop + 1]
            out[s.request_id] = tuple(prompt_logprobs(logits[first_row:first_row + len(next_ids)], next_ids,
                                                      request.params.prompt_logprobs or 0))
        return out

    def score(self, ids: list[int], first: int) -> torch.Tensor:
        """Log-probabilities of the whole vocabulary after positions first .. len(ids) - 2 of one sequence,
        float32 on the host `[len(ids) - 1 - first, vocab]` (row i predicts ids[first + 1 + i]). The sequence is
        prefilled in chunks of a step's token budget, as a prompt is, each chunk one step of the expert
        cache. Only while no request runs: it uses KV slot 0."""
        if self.has_unfinished():
            raise RuntimeError("score runs only while no request runs")
        if not 0 <= first < len(ids) - 1 or len(ids) > self.max_model_len:
            raise ValueError(f"need 0 <= first < {len(ids) - 1} and at most {self.max_model_len} tokens")
        rows: list[torch.Tensor] = []
        budget = self.scheduler.config.max_num_batched_tokens
        for start in range(0, len(ids) - 1, budget):
            chunk = ids[start:min(start + budget, len(ids) - 1)]
            logprobs: list[torch.Tensor] = []
            self.forward([SeqSpan(0, start, len(chunk))], [chunk], ["score"] * len(chunk), _log_softmax_into(logprobs),
                         [first])
            if start + len(chunk) > first:  # else the one row computed is the chunk's last, before `first`
                rows.append(logprobs[0])
        self.cache.flush()
        return torch.cat(rows)

    def forward(self, spans: list[SeqSpan], token_ids: list[list[int]], keys: list[str],
                consume: Callable[[torch.Tensor], None], logits_from: list[int] | None = None) -> StepRecord:
        """One forward pass with the expert cache's protocol around it; `consume(logits)` reads the logits
        (it waits for the device). `keys`: the request of each token; `logits_from`: see `ForwardBatch.build`.
        Returns the step record. Only while no step is launched ahead."""
        logits, ticket = self._launch_forward(spans, token_ids, keys, logits_from)
        consume(logits)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.devices[-1]).synchronize()  # NOTE: the step record is complete
        return self.cache.step_done(ticket)  # this step's record, processed while the next step runs

    def _launch_forward(self, spans: list[SeqSpan], token_ids: list[list[int]], keys: list[str],
                        logits_from: list[int] | None = None, on_launched: Callable[[], None] | None = None,
                        feed: torch.Tensor | None = None) -> tuple[torch.Tensor, StepTicket]:
        """Launch one forward pass with the expert cache's protocol around it: its logits (not waited for) and its
        ticket for `ExpertCache.step_done`. `on_launched`: called once the pass is launched; `feed`: see
        `ModelRunner.forward`."""
        self.model.router.begin_step(keys)
        self.cache.prepare_step(len(keys))  # a. the table changes decided during the last step, for the device
        logits = self.runner.forward(spans, token_ids, logits_from, feed)  # b. launched
        ticket = self.cache.launched()
        if self.split is not None and self.device.type == "cuda":
            join_streams(self.devices)
        if on_launched is not None:
            on_launched()
        # c. while the device computes: the previous step's cache bookkeeping, the router's work ahead
        self.cache.process()
        self.model.router.while_running()
        return logits, ticket

    def update(self, sched: SchedulerOutput, result: StepOutput) -> list[RequestOutput]:
        outputs = []
        for s in sched.seqs:
            state = self.states.get(s.request_id)
            if state is None:  # ended while a step ahead ran for it
                continue
            if s.start == 0:
                self.counters["prompt_tokens"] += len(self.scheduler.requests[s.request_id].request.prompt_ids)
            if state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(result.prompt_logprobs.get(s.request_id, ()))
            token = result.sampled.get(s.request_id)
            if token is not None:
                outputs.append(self._advance(s.request_id, state, token, result.logprobs.get(s.request_id)))
        if sched.num_tokens == len(sched.seqs) and result.seconds > 0:
            self._decode_rate = len(sched.seqs) / result.seconds
        return outputs

    def _advance(self, request_id: str, state: RequestState, token: int,
                 logprob: TokenLogprob | None) -> RequestOutput:
        self.counters["generation_tokens"] += 1
        reason = self.scheduler.append_token(request_id, token)
        if reason != "stop" and state.text.add(token):  # a stop string; a stop token's text is never shown
            reason = "stop"
        lps = (logprob,) if logprob else ()
        if reason is not None:
            return self._output(self.scheduler.finish(request_id), (token,), lps, reason)
        seq = self.scheduler.requests[request_id]
        return RequestOutput(request_id, (token,), state.text.emit(), lps,
                             num_prompt_tokens=len(seq.request.prompt_ids),
                             num_generated_tokens=len(seq.output_ids), prompt_logprobs=state.take_prompt_logprobs())

    def _output(self, seq: Sequence, tokens: tuple[int, ...], lps: tuple, reason: str) -> RequestOutput:
        """The last output of a request the scheduler ended; the engine's state of it goes."""
        state = self.states.pop(seq.request_id)
        return RequestOutput(seq.request_id, tokens, state.text.finish(), lps, True, reason,
                             len(seq.request.prompt_ids), len(seq.output_ids),
                             prompt_logprobs=state.take_prompt_logprobs())

    def reconfigure_cache(self, cache: CacheConfig) -> list[str]:
        """Replace the expert cache (placement, budget, policy, miss mode) while idle, keeping the loaded
        weights and host experts; returns the old cache's summary lines."""
        if self.has_unfinished():
            raise RuntimeError("the cache can only be replaced while no request runs")
        summary = self.cache.close()
        self.config = replace(self.config, cache=cache)
        for device in self.devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        self.runner.graphs.clear()  # graphs captured the old cache's tables and pools
        self.cache = self._build_cache(cache)
        self.model.experts = self.cache.dispatcher
        self.runner = self._make_runner()  # a fresh graph memory pool for the new captures
        self.launches_async = self._launches_async()
        self.decodes_ahead = self._decodes_ahead()
        return summary

    def _decodes_ahead(self) -> bool:
        """Decode ahead (`step`): `on` wherever the cache decides nothing (`ExpertCache.is_static`: no step's
        table changes depend on the step before); `auto` there too, on CUDA with the decode steps captured. NOTE: one
        device only: a split model samples on its last device and its next step starts on the first."""
        mode = self.config.scheduler.decode_ahead
        return self.split is None and self.cache.is_static and (mode == "on" or mode == "auto" and self.launches_async
                                                                 and self.runner.use_graphs)

    def _launches_async(self) -> bool:
        """Whether a step's device work runs on after `forward` returns: on CUDA, where no layer syncs the host
        (none on disk; CPU tasks the device rings for)."""
        return self.device.type == "cuda" and self.cache.dispatcher.is_graph_safe

    def _build_cache(self, cache: CacheConfig) -> ExpertCache:
        kv_bytes = [sum(self.kv.layer_bytes(i) for i in layers) for layers, _ in self._stages()] \
            if self.split is not None else [self.kv.num_bytes]
        return build_expert_cache(self.store, cache, self.scheduler.config.max_num_batched_tokens,
                                  self.weights.moe_layers, self.weights.hparams.num_layers, kv_bytes, self.split)

    def _make_runner(self) -> ModelRunner:
        return ModelRunner(self.model, self.kv, self.cache.dispatcher, self.scheduler.config.max_num_seqs,
                           self.config.model.cuda_graphs, self.scheduler.config.max_num_batched_tokens)

    def capture_graphs(self) -> None:
        """Capture every decode graph now (a server at start-up): no request waits for a capture."""
        start = time.perf_counter()
        if count := self.runner.capture_all():
            log.info("captured %d decode graphs in %.1f s", count, time.perf_counter() - start)

    def set_router(self, router: Router) -> None:
        """Replace the model's router (benchmarks, trace replay) while idle; graphs are captured anew."""
        if self.has_unfinished():
            raise RuntimeError("the router can only be replaced while no request runs")
        self.model.router = router
        self.runner = self._make_runner()

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(s.num_running, s.num_waiting, s.kv_usage(), self.counters["steps"],
                           self.counters["prompt_tokens"], self.counters["generation_tokens"], self._decode_rate)

    def close(self) -> None:
        for line in self.cache.close():
            log.info(line)
        if self.config.cache.record_trace and self.traces is not None and self.traces.streams:
            self.traces.save(self.config.cache.record_trace)


def _log_softmax_into(rows: list[torch.Tensor]) -> Callable[[torch.Tensor], None]:
    """Host float32 log-probabilities of each step's logits (`score`'s rows, read by numpy)."""
    return lambda logits: rows.append(torch.log_softmax(logits.float(), dim=-1).cpu())


def _bytes_progress(progress: Callable[[str, int, int], None] | None,
                    gguf: GGUFFile) -> Callable[[int], None] | None:
    if progress is None:
        return None
    total, done = gguf.file_bytes, [0]

    def advance(num_bytes: int) -> None:
        done[0] += num_bytes
        progress("loading", min(done[0], total), total)

    return advance
