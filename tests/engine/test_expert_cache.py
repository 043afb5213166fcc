"""The expert cache on the CPU: every invariant of DESIGN.md, on random routings, budgets, policies, miss
modes and batch sizes, with real GGUF expert bytes, the real copy thread and the engine's step protocol
(table changes applied at the next step, the step record processed while the next step runs)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.expert_cache.cache import ExpertCache, build_expert_cache
from engine.expert_cache.device import CopyEngine, CopyHandle
from engine.expert_cache.plan import CacheBudgetError
from engine.expert_cache.policy import Decision, Promotion
from engine.expert_cache.profile import Profile
from engine.expert_cache.record import HIT, LANDED, ON_CPU, PAD, STAGED, StepRecord
from engine.expert_cache.store import ExpertStore
from engine.gguf.reader import GGUFFile
from engine.llm_engine import LLMEngine
from engine.trace import RoutingTrace
from engine.types import Request, SamplingParams
from engine.weights import ModelWeights, load_weights
from ops.cache_step import PUBLISH, begin_step_torch
from tests.engine.reference_experts import ReferenceExperts
from tools.routing import make_router
from tools.synth import PRESETS, with_overrides, write_synth

CPU = torch.device("cpu")
TOLERANCE = 1e-3  # the native CPU kernel: ~1e-4 (two int8 activation planes); one missing or doubled pair moves ~40%
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def weights(small_moe_gguf: Path) -> ModelWeights:
    return load_weights(GGUFFile(small_moe_gguf), CPU, torch.float32)


def make_cache(weights: ModelWeights, **cfg: object) -> ExpertCache:
    config = CacheConfig(**{"cpu_moe": True, **cfg})  # type: ignore[arg-type]
    return build_expert_cache(ExpertStore(weights, CPU), config, MAX_TOKENS, weights.moe_layers,
                              weights.hparams.num_layers)


def random_step(rng: np.random.Generator, num_tokens: int, num_experts: int, top_k: int,
                hot: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, expert ids `[tokens, top_k]` (distinct per token, drawn mostly from a hot set), weights."""
    ids = np.stack([rng.choice(hot if rng.random() < 0.8 else np.arange(num_experts), top_k, replace=False)
                    for _ in range(num_tokens)])
    x = torch.from_numpy(rng.standard_normal((num_tokens, 256)).astype(np.float32))
    w = torch.from_numpy(rng.random((num_tokens, top_k)).astype(np.float32) + 0.1)
    return x, torch.from_numpy(ids).long(), w


def step(cache: ExpertCache, layers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
         num_tokens: int) -> tuple[dict[int, torch.Tensor], StepRecord]:
    """One step as the engine runs it: changes out, the step, uploads started, the last record processed,
    this step's record taken."""
    cache.prepare_step(num_tokens)
    cache.dispatcher.begin_step(num_tokens)
    outs = {layer: cache.dispatcher(layer, *args) for layer, args in layers.items()}
    cache.dispatcher.end_step()
    cache.launched()
    cache.process()
    return outs, cache.step_done()


def settle(cache: ExpertCache) -> None:
    """Between steps, as long as it takes: decisions made, uploads done, every change applied."""
    cache.flush()
    cache.manager.start_uploads()
    cache.manager.wait_uploads()
    changes = cache.manager.changes() or [(0, 0, 0, 0)]
    begin_step_torch(cache.manager.tables, cache.dispatcher.record.device, torch.tensor([len(changes), 0]),
                     torch.tensor(changes))


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def published_bytes_match(cache: ExpertCache) -> bool:
    """Every expert the device tables publish holds exactly that expert's bytes in its slot."""
    m = cache.manager
    for layer, row in cache.dispatcher.rows.items():
        if layer not in m.host:
            continue
        for expert in np.nonzero(m.tables.state[row].numpy() >= 0)[0].tolist():
            slot = int(m.tables.state[row, expert])
            pool, host = m.pools[m.group_of[layer]], m.host[layer]
            for part in ("gate", "up", "down"):
                if not torch.equal(getattr(pool, part)[slot], getattr(host, part)[expert]):
                    return False
    return True


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy=st.sampled_from(["lru", "decay", "lfru"]), mode=st.sampled_from(["cpu", "stream", "hybrid"]),
       budget_mib=st.sampled_from([0, 1, 2, 4]), sizes=st.lists(st.sampled_from([1, 2, 5, 8, 32, 40]),
                                                               min_size=3, max_size=6), seed=st.integers(0, 99))
def test_outputs_equal_reference_and_invariants_hold(weights: ModelWeights, policy: str, mode: str,
                                                     budget_mib: int, sizes: list[int], seed: int) -> None:
    cache = make_cache(weights, policy=policy, miss_mode=mode, budget_mib=budget_mib, promote_per_step=4)
    ref = ReferenceExperts({i: weights.layers[i].ffn.experts for i in weights.moe_layers})
    hp, rng = weights.hparams, np.random.default_rng(seed)
    hot = rng.choice(hp.num_experts, 6, replace=False)
    assert cache.plan.cache_bytes <= budget_mib << 20  # NOTE: the budget is never exceeded
    picks = 0
    for size in sizes + [1]:  # the last step publishes the landings of the one before
        if size > 32:
            cache.flush()  # the decisions of the decode steps before
        before = cache.manager.residents() if size > 32 else None
        layers = {layer: random_step(rng, size, hp.num_experts, hp.top_k, hot) for layer in weights.moe_layers}
        outs, record = step(cache, layers, size)
        for layer, (x, ids, w) in layers.items():
            assert rel_error(outs[layer], ref(layer, x, ids, w)) < TOLERANCE
        # NOTE: exactly once: every pair has one outcome, and padding none
        assert set(np.unique(record.outcome)) <= {HIT, STAGED, LANDED, ON_CPU}
        assert (record.outcome == LANDED).sum() == 0 or mode != "cpu"
        if before is not None:  # NOTE: a prefill batch never promotes or evicts
            cache.process()
            assert cache.manager.residents() == before and not (record.outcome == LANDED).any()
        assert published_bytes_match(cache)  # NOTE: published only once its bytes are in the slot
        picks += size * hp.top_k * len(weights.moe_layers)
    cache.flush()
    snap = cache.stats.snapshot()
    assert snap.hits() + snap.misses() == picks  # NOTE: every pair counted exactly once
    # NOTE: one crossing per miss: a streamed miss lands or is not promoted, never uploaded again; hybrid uploads
    # only misses the CPU computed (experts that never crossed)
    slot_bytes = cache.manager.groups[0].slot_bytes if cache.manager.groups else 0
    if mode == "stream":
        assert snap.uploaded_bytes == 0
    elif mode == "hybrid":
        assert snap.uploaded_bytes <= snap.cpu_experts * slot_bytes
    cache.close()


def test_a_landed_miss_is_a_hit_from_the_next_step(weights: ModelWeights) -> None:
    cache = make_cache(weights, policy="lru", miss_mode="stream", budget_mib=2)
    layer = weights.moe_layers[0]
    args = random_step(np.random.default_rng(0), 1, 16, 4, np.arange(16))
    _, first = step(cache, {layer: args}, 1)
    row = cache.dispatcher.rows[layer]
    assert first.outcome[row].tolist() == [LANDED] * 4
    _, second = step(cache, {layer: args}, 1)
    assert second.outcome[row].tolist() == [HIT] * 4 and second.slot[row].tolist() == first.slot[row].tolist()
    cache.flush()
    snap = cache.stats.snapshot()
    assert snap.promotions == 4 and snap.uploaded_bytes == 0 and snap.streamed_bytes == 4 * cache.manager.groups[0]\
        .slot_bytes
    cache.close()


def test_every_miss_goes_to_the_cpu_and_only_the_misses(weights: ModelWeights) -> None:
    """cpu mode: hits on the device, misses on the CPU: the CPU job flags exactly the misses."""
    cache = make_cache(weights, policy="lru", miss_mode="cpu", budget_mib=1)  # 9 slots
    rng, layer = np.random.default_rng(0), weights.moe_layers[0]
    for _ in range(6):  # warm the cache
        step(cache, {layer: random_step(rng, 4, 16, 4, np.arange(8))}, 4)
    settle(cache)
    state = cache.manager.tables.state[cache.dispatcher.rows[layer]]
    cached, uncached = (state >= 0).nonzero()[:, 0], (state < 0).nonzero()[:, 0]
    assert len(cached) >= 4 and len(uncached) >= 4
    x, _, w = random_step(rng, 2, 16, 4, np.arange(8))
    ids = torch.stack([torch.cat([cached[:2], uncached[:2]]), torch.cat([uncached[2:4], cached[2:4]])])
    slots = state[ids]
    _, record = step(cache, {layer: (x, ids, w)}, 2)
    job = cache.cpu.job if cache.cpu is not None else None
    assert job is not None
    flagged = job.on_cpu[:ids.numel()].bool()
    assert torch.equal(flagged, (slots < 0).flatten())
    assert 0 < int(flagged.sum()) < ids.numel()
    outcome = record.outcome[cache.dispatcher.rows[layer]]
    assert np.array_equal(outcome == ON_CPU, flagged.numpy()) and np.array_equal(outcome == HIT, ~flagged.numpy())
    cache.close()


class GatedCopies(CopyEngine):
    """Copies that finish only when the test says so (the slow PCIe of a real machine)."""

    def __init__(self) -> None:
        super().__init__(CPU)
        self.gate = threading.Event()

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> CopyHandle:
        def run() -> None:
            self.gate.wait()
            for dst, src in pairs:
                dst.copy_(src)
        return CopyHandle(future=self.thread.submit(run))


def test_uploads_publish_only_after_their_copy(weights: ModelWeights) -> None:
    cache = make_cache(weights, policy="lru", miss_mode="cpu", budget_mib=1)
    cache.manager.copies = GatedCopies()
    layer = weights.moe_layers[0]
    x, ids, w = random_step(np.random.default_rng(1), 2, 16, 4, np.arange(16))
    for _ in range(3):  # the first step's uploads are decided during the second, started after the third's launch
        again, _ = step(cache, {layer: (x, ids, w)}, 2)
    assert cache.stats.snapshot().promotions > 0
    assert int((cache.manager.tables.state >= 0).sum()) == 0  # nothing published during the copies
    again, _ = step(cache, {layer: (x, ids, w)}, 2)
    cache.flush()
    assert cache.stats.snapshot().hits() == 0
    cache.manager.copies.gate.set()
    cache.manager.wait_uploads()
    after, record = step(cache, {layer: (x, ids, w)}, 2)  # publishes at its start
    assert (record.outcome[cache.dispatcher.rows[layer]] == HIT).any()
    assert int((cache.manager.tables.state >= 0).sum()) > 0 and published_bytes_match(cache)
    assert rel_error(after[layer], again[layer]) < TOLERANCE
    cache.close()


def test_a_slot_reassigned_in_flight_is_not_published_for_the_old_expert(weights: ModelWeights) -> None:
    cache = make_cache(weights, policy="lru", miss_mode="cpu", budget_mib=1)  # 9 slots for 4 layers
    cache.manager.copies = GatedCopies()
    rng = np.random.default_rng(2)
    for _ in range(5):  # many uploads while nothing completes: slots get reassigned
        step(cache, {layer: random_step(rng, 3, 16, 4, np.arange(16)) for layer in weights.moe_layers}, 3)
    cache.manager.copies.gate.set()
    settle(cache)
    residents = cache.table_residents()
    assert len(set(residents.values())) == len(residents)  # a slot holds one expert
    assert published_bytes_match(cache)
    cache.close()


def test_an_upload_evicted_before_it_started_is_never_published(weights: ModelWeights) -> None:
    """Two decisions with no launch between them (the engine flushes before a prompt and when idle): the second
    evicts what the first queued for upload; that copy is dropped, so the slot's next owner is the only one."""
    cache = make_cache(weights, policy="lru", miss_mode="cpu", budget_mib=1)
    m, layer = cache.manager, weights.moe_layers[0]
    row = cache.dispatcher.rows[layer]
    m._apply(0, Decision(uploads=[Promotion(3, layer, 5, None)]))  # queued, started after the next launch
    m._apply(0, Decision(evictions=[((layer, 5), 3)]))
    m.start_uploads()
    m.wait_uploads()
    assert not [c for c in m.changes() if c[0] == PUBLISH and c[1:3] == (row, 5)]
    assert m.published[row, 5] == -1
    cache.close()


def test_hybrid_uploads_the_cpus_misses_and_lands_nothing_in_a_slot_still_being_copied(weights: ModelWeights) -> None:
    """hybrid: streamed misses land, the CPU's are uploaded (they never crossed); a slot whose upload is still
    copying when the policy frees it is offered to the device only once that copy is done."""
    cache = make_cache(weights, policy="lru", miss_mode="hybrid", budget_mib=1)  # 9 slots for 4 layers
    cache.manager.tables.share.fill_(0.5)  # half of each layer's misses on the CPU
    cache.manager.copies = GatedCopies()
    ref = ReferenceExperts({i: weights.layers[i].ffn.experts for i in weights.moe_layers})
    rng = np.random.default_rng(3)
    held = 0
    for _ in range(6):  # uploads decided while none completes, slots freed and offered meanwhile
        layers = {layer: random_step(rng, 2, 16, 4, np.arange(16)) for layer in weights.moe_layers}
        outs, record = step(cache, layers, 2)
        for layer, args in layers.items():
            assert rel_error(outs[layer], ref(layer, *args)) < TOLERANCE
        busy = cache.manager._copy_targets()
        held += len(cache.manager._held_offers)
        ring = cache.manager.tables.ring[0, :].tolist()
        head, tail = int(cache.manager.tables.head[0]), int(cache.manager.tables.tail[0])
        live = {ring[i % len(ring)] for i in range(head, tail)}  # what the device may land in now
        assert not {slot for gid, slot in busy} & live, "a slot being copied is on the device's ring"
    assert cache.stats.snapshot().uploaded_bytes > 0 and held > 0
    cache.manager.copies.gate.set()
    settle(cache)
    assert published_bytes_match(cache)
    layers = {layer: random_step(rng, 2, 16, 4, np.arange(16)) for layer in weights.moe_layers}
    outs, record = step(cache, layers, 2)
    assert all(rel_error(outs[layer], ref(layer, *args)) < TOLERANCE for layer, args in layers.items())
    assert published_bytes_match(cache)
    cache.close()


def test_the_link_load_counts_the_decode_steps_own_time(weights: ModelWeights) -> None:
    """The link's load (it decides whether hybrid uploads the CPU's misses) is the streamed bytes over the decode
    steps' own time: a prompt and an idle stretch between two decode steps do not dilute it."""
    cache = make_cache(weights, policy="lru", miss_mode="stream", budget_mib=1)
    seen: list[tuple[int, float]] = []
    add = cache.split.link.add
    cache.split.link.add = lambda num_bytes, seconds: (seen.append((num_bytes, seconds)), add(num_bytes, seconds))[-1]
    rng = np.random.default_rng(5)

    def run(tokens: int) -> None:
        step(cache, {layer: random_step(rng, tokens, 16, 4, np.arange(16)) for layer in weights.moe_layers}, tokens)

    run(1)
    run(1)
    time.sleep(0.3)  # idle, then a prompt (more tokens than a cached step: prefill, not counted)
    run(MAX_TOKENS)
    run(1)
    cache.flush()
    assert len(seen) == 3 and all(num_bytes > 0 for num_bytes, _ in seen)  # the decode steps, each streamed
    assert all(0 < seconds < 0.3 for _, seconds in seen), seen
    cache.close()


def test_budget_that_caches_nothing_is_a_clear_error(tmp_path: Path, vocab: dict) -> None:
    path = tmp_path / "wide.gguf"  # experts of 0.84 MiB, top-4: four slots need 4 MiB
    write_synth(path, with_overrides(PRESETS["tiny"], expert_ff=2048, top_k=4), vocab)
    wide = load_weights(GGUFFile(path), CPU, torch.float32)
    assert wide.layers[0].ffn.experts.expert_bytes == 3 * 2048 * 144
    with pytest.raises(CacheBudgetError, match=r"smallest useful budget is 4 MiB"):
        make_cache(wide, budget_mib=3)
    make_cache(wide, budget_mib=4).close()
    make_cache(wide, budget_mib=0).close()  # no cache at all is valid: every miss on the CPU


def test_n_cpu_moe_places_the_first_layers_in_host_ram(weights: ModelWeights) -> None:
    cache = make_cache(weights, cpu_moe=False, n_cpu_moe=2, budget_mib=0)
    moe = weights.moe_layers
    assert cache.placement.host_layers == tuple(moe[:2]) and cache.placement.resident_layers == tuple(moe[2:])
    cache.close()


@pytest.mark.parametrize("mode", ["cpu", "stream"])
def test_profile_warm_start_and_static_policy(weights: ModelWeights, tmp_path: Path, mode: str) -> None:
    profile = Profile({layer: {e: 10 - e for e in range(6)} for layer in weights.moe_layers})
    path = tmp_path / "profile.json"
    profile.save(path)
    cache = make_cache(weights, policy="static", budget_mib=2, profile_in=str(path), miss_mode=mode)
    settle(cache)  # the warm start's publications apply at the first step
    residents = cache.table_residents()
    assert residents and all(expert < 6 for _, expert in residents) and published_bytes_match(cache)
    rng = np.random.default_rng(3)
    for _ in range(3):
        step(cache, {layer: random_step(rng, 2, 16, 4, np.arange(16)) for layer in weights.moe_layers}, 2)
    cache.flush()
    assert cache.table_residents() == residents  # static never changes
    cache.close()


def test_engine_stats_add_up(small_moe_gguf: Path, tmp_path: Path) -> None:
    """The real engine on a Qwen3-MoE GGUF with a small cache: hits + misses = selected experts,
    uploaded bytes = uploads x expert bytes; the profile and trace are written at close."""
    profile, trace = tmp_path / "p.json", tmp_path / "t.npz"
    cfg = EngineConfig(model=ModelConfig(str(small_moe_gguf), device="cpu", max_context=128),
                       cache=CacheConfig(cpu_moe=True, budget_mib=2, policy="lru", miss_mode="cpu",
                                         profile_out=str(profile), record_trace=str(trace)),
                       scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    engine = LLMEngine(cfg)
    for i in range(3):
        engine.add_request(Request(f"r{i}", tuple(engine.tokenizer.encode(f"hello number {i}")),
                                   SamplingParams(max_tokens=6, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    snap = engine.cache.snapshot()
    hp = engine.weights.hparams
    computed = engine.counters["prompt_tokens"] + engine.counters["generation_tokens"] - 3
    assert snap.hits() + snap.misses() == computed * hp.top_k * len(engine.weights.moe_layers)
    assert snap.uploaded_bytes == snap.promotions * engine.weights.layers[0].ffn.experts.expert_bytes
    assert snap.hits() > 0 and snap.cpu_experts > 0
    engine.close()
    assert profile.exists() and trace.exists()


def test_hybrid_streams_the_first_share_of_the_misses(weights: ModelWeights) -> None:
    cache = make_cache(weights, miss_mode="hybrid", budget_mib=0)
    layer = weights.moe_layers[0]
    row = cache.dispatcher.rows[layer]
    cache.manager.tables.share[row] = 0.5
    ref = ReferenceExperts({i: weights.layers[i].ffn.experts for i in weights.moe_layers})
    x, ids, w = random_step(np.random.default_rng(4), 6, 16, 4, np.arange(16))
    outs, record = step(cache, {layer: (x, ids, w)}, 6)
    assert rel_error(outs[layer], ref(layer, x, ids, w)) < TOLERANCE
    first = list(dict.fromkeys(ids.flatten().tolist()))  # the missed experts in pair order
    streamed = first[:round(len(first) / 2 + 1e-9)]
    outcome = record.outcome[row]
    assert all((outcome[p] == STAGED) == (e in streamed) for p, e in enumerate(ids.flatten().tolist()))
    cache.flush()
    snap = cache.stats.snapshot()
    assert snap.cpu_experts == len(first) - len(streamed)
    assert snap.streamed_bytes == len(streamed) * weights.layers[0].ffn.experts.expert_bytes
    cache.close()


def run_one(path: Path, trace_out: Path, routing: str = "model") -> list[int]:
    cfg = EngineConfig(model=ModelConfig(str(path), device="cpu", max_context=128),
                       cache=CacheConfig(cpu_moe=True, budget_mib=1, record_trace=str(trace_out)),
                       scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32))
    engine = LLMEngine(cfg)
    engine.set_router(make_router(routing, engine.weights, 32, engine.device))
    engine.add_request(Request("a", tuple(engine.tokenizer.encode("a recorded request")),
                               SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
    ids = []
    while engine.has_unfinished():
        ids += [t for out in engine.step() for t in out.new_token_ids]
    engine.close()
    return ids


def test_recorded_trace_replays_the_same_routing(small_moe_gguf: Path, tmp_path: Path) -> None:
    first = run_one(small_moe_gguf, tmp_path / "first.npz")
    trace = RoutingTrace.load(tmp_path / "first.npz")
    num_prompt = len(LLMEngine(EngineConfig(model=ModelConfig(str(small_moe_gguf), device="cpu")))
                     .tokenizer.encode("a recorded request"))
    assert trace.expert_ids.shape == (num_prompt + 7, 4, 4) and trace.layers == (0, 1, 2, 3)
    replayed = run_one(small_moe_gguf, tmp_path / "second.npz", routing=f"trace:{tmp_path / 'first.npz'}")
    assert replayed == first
    assert np.array_equal(RoutingTrace.load(tmp_path / "second.npz").expert_ids, trace.expert_ids)


def test_reconfigure_keeps_weights_and_swaps_the_cache(small_moe_gguf: Path) -> None:
    engine = LLMEngine(EngineConfig(model=ModelConfig(str(small_moe_gguf), device="cpu", max_context=64),
                                    cache=CacheConfig(cpu_moe=True, budget_mib=0)))
    host_before = engine.store.host(0)
    for cfg in (CacheConfig(cpu_moe=True, budget_mib=2, policy="decay", miss_mode="stream"),
                CacheConfig(n_cpu_moe=2, budget_mib=1, policy="lfru")):
        engine.reconfigure_cache(cfg)
        assert engine.cache.cfg == cfg and engine.model.experts is engine.cache.dispatcher
        engine.add_request(Request("r", (1, 2, 3), SamplingParams(max_tokens=4, ignore_eos=True)))
        while engine.has_unfinished():
            engine.step()
        assert engine.cache.snapshot().hits() + engine.cache.snapshot().misses() > 0
    assert engine.store.host(0) is host_before  # one host copy of the experts, shared by every cache
    assert engine.cache.placement.resident_layers == (2, 3)


def test_usage_snapshot_marks_cached_resident_and_recent_experts(weights: ModelWeights) -> None:
    cache = make_cache(weights, cpu_moe=False, n_cpu_moe=2, budget_mib=2, miss_mode="stream")
    x, ids, w = random_step(np.random.default_rng(5), 3, 16, 4, np.arange(16))
    step(cache, {layer: (x, ids, w) for layer in weights.moe_layers}, 3)
    cache.flush()
    usage, where = cache.usage_snapshot()
    assert usage.shape == (4, 16) and (where[:2] <= 1).all() and (where[2:] == 2).all()
    picked = np.zeros(16)
    np.add.at(picked, ids.flatten().numpy(), 1)
    assert np.allclose(usage, np.tile(picked, (4, 1)))  # every layer, resident ones included
    assert {(layer, expert) for layer, expert in zip(*np.nonzero(where == 1))} == set(cache.table_residents())
    assert cache.table_residents()  # the step's misses landed
    cache.close()


def test_padding_rows_route_nowhere(weights: ModelWeights) -> None:
    cache = make_cache(weights, miss_mode="stream", budget_mib=2)
    layer = weights.moe_layers[0]
    x, ids, w = random_step(np.random.default_rng(6), 4, 16, 4, np.arange(16))
    ids[2:] = -1  # the padding rows of a captured batch
    outs, record = step(cache, {layer: (x, ids, w)}, 4)
    row = cache.dispatcher.rows[layer]
    assert (record.outcome[row][8:] == PAD).all() and (record.ids[row][8:] == -1).all()
    assert torch.equal(outs[layer][2:], torch.zeros(2, 256))
    cache.close()
