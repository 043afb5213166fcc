"""The expert cache's device-side steps (`ops.cache_step`): what the torch references do, on hand-made
tables, and that the Triton kernels compute the same tables, records and CPU jobs on random ones
(GPU-marked; without CUDA under Triton's interpreter in a subprocess)."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

from ops import cache_step as cs
from tests.ops.interpreter import interpret_main, needs_no_cuda, run_interpreted

E = 16  # experts per layer


def tables(layers: int = 2, rings: int = 1, capacity: int = 8, seed: int = 0, cached: int = 4) -> cs.SlotTables:
    """Random tables: `cached` experts of each layer published in slots 10 * layer + i."""
    g = torch.Generator().manual_seed(seed)
    state = torch.full((layers, E), -1, dtype=torch.int32)
    for layer in range(layers):
        experts = torch.randperm(E, generator=g)[:cached]
        state[layer, experts] = torch.arange(cached, dtype=torch.int32) + 10 * layer
    host = torch.randint(1 << 20, 1 << 30, (layers, 3, E), generator=g) * 16
    return cs.SlotTables(
        state=state, cur=torch.where(state[:, None, :] >= 0, host + 1, 0), host=host, staging=host + 2,
        fill=torch.full((layers, E), 7, dtype=torch.int8), scratch=torch.zeros(layers, E, dtype=torch.int32),
        pool_base=torch.randint(1 << 32, 1 << 33, (layers, 3), generator=g) * 16,
        pool_stride=torch.tensor([[4096, 4096, 2048]] * layers), region=torch.arange(layers, dtype=torch.int32) % rings,
        ring=torch.arange(rings * capacity, dtype=torch.int32).view(rings, capacity) + 100,
        head=torch.zeros(rings, dtype=torch.int64), tail=torch.full((rings,), 2, dtype=torch.int64),
        share=torch.ones(layers, dtype=torch.float32), lead=torch.zeros(layers, dtype=torch.float32))


def clone(t: cs.SlotTables) -> cs.SlotTables:
    return cs.SlotTables(*(getattr(t, f).clone() for f in cs.SlotTables.__dataclass_fields__))


def on_device(t: cs.SlotTables, to) -> cs.SlotTables:  # noqa: ANN001
    return cs.SlotTables(*(to(getattr(t, f).clone()) for f in cs.SlotTables.__dataclass_fields__))


def assign(t: cs.SlotTables, ids: list[list[int]], landing: bool = True, row: int = 0,
           job: cs.CpuJob | None = None) -> torch.Tensor:
    expert_ids = torch.tensor(ids)
    record = torch.zeros(expert_ids.numel(), 3, dtype=torch.int32)
    x = torch.arange(expert_ids.shape[0] * 4, dtype=torch.float32).view(-1, 4)
    cs.assign_experts_torch(row, expert_ids, torch.full(expert_ids.shape, 0.5), x, t, record, landing, job)
    return record.T  # [3 (ids, outcome, slot), pairs]


def test_hits_keep_their_slots_and_misses_land_in_ring_order() -> None:
    t = tables()
    hit, *missed = [int(e) for e in (t.state[0] >= 0).nonzero()[:1, 0]] + \
        [e for e in range(E) if t.state[0, e] < 0][:3]
    record = assign(t, [[hit, missed[0], missed[1], missed[2]]])
    assert record[0].tolist() == [hit, *missed]
    # two offered slots (tail 2): the first two misses land in ring order, the third is staged
    assert record[1].tolist() == [cs.HIT, cs.LANDED, cs.LANDED, cs.STAGED]
    assert record[2].tolist() == [int(t.state[0, hit]), 100, 101, -1]
    assert int(t.head[0]) == 2
    assert t.cur[0, :, missed[0]].tolist() == (t.pool_base[0] + 100 * t.pool_stride[0]).tolist()
    assert t.cur[0, :, missed[2]].tolist() == t.staging[0, :, missed[2]].tolist()
    assert [int(t.fill[0, e]) for e in [hit, *missed]] == [0, 1, 1, 1]
    assert int(t.state[0, missed[0]]) == -1  # NOTE: published by the next step's begin_step, not here


def test_an_expert_chosen_by_several_tokens_is_decided_once() -> None:
    t = tables(cached=0)
    record = assign(t, [[3, 5], [5, 3], [3, 9]])
    assert record[1].tolist() == [cs.LANDED, cs.LANDED, cs.LANDED, cs.LANDED, cs.LANDED, cs.STAGED]
    assert record[2].tolist() == [100, 101, 101, 100, 100, -1]
    assert int(t.head[0]) == 2


def test_without_landing_misses_are_staged_and_the_ring_is_untouched() -> None:
    t = tables(cached=0)
    record = assign(t, [[1, 2]], landing=False)
    assert record[1].tolist() == [cs.STAGED, cs.STAGED] and int(t.head[0]) == 0


def test_hybrid_streams_the_first_share_of_misses_and_gives_the_rest_to_the_cpu() -> None:
    t = tables(cached=0)
    t.share[0] = 0.5
    bell = cs.Bell.allocate(torch.device("cpu"))
    bell.state[0] = 41  # the last ring's number
    job = cs.CpuJob.allocate(4, 2, 4, pin=False, bell=bell)
    record = assign(t, [[1, 2], [3, 1], [4, 5]], job=job)  # misses 1, 2, 3, 4, 5: round(2.5) = 3 streamed
    assert record[1].tolist() == [cs.LANDED, cs.LANDED, cs.STAGED, cs.LANDED, cs.ON_CPU, cs.ON_CPU]
    assert t.cur[0, :, 4].tolist() == [0, 0, 0] and int(t.fill[0, 4]) == 0  # the device skips CPU experts
    assert job.on_cpu[:6].tolist() == [0, 0, 0, 0, 1, 1] and job.expert_ids[:6].tolist() == [1, 2, 3, 1, 4, 5]
    assert int(job.num_tokens[0]) == 3 and job.x[:3].flatten().tolist() == list(range(12))
    # the job written, the layer rings for its task (row 0) with the next number
    assert bell.state.tolist() == [42, 1] and int(bell.words[cs.Bell.RING]) == 42 << cs.TASK_BITS | 0
    t.share[0] = 1.0
    assign(t, [[6, 7], [8, 9], [1, 2]], job=job)  # every miss streamed: no CPU pair, no ring
    assert bell.state.tolist() == [42, 0] and int(bell.words[cs.Bell.RING]) == 42 << cs.TASK_BITS
    # nor a job: host memory keeps the last one (the host reads a job only when its layer rang)
    assert job.on_cpu[:6].tolist() == [0, 0, 0, 0, 1, 1] and job.expert_ids[:6].tolist() == [1, 2, 3, 1, 4, 5]


@pytest.mark.parametrize(("lead", "streamed"), [(0.0, 3), (0.6, 3), (1.0, 4), (9.0, 5)])
def test_the_lead_streams_misses_the_cpu_would_not_pay_for(lead: float, streamed: int) -> None:
    t = tables(cached=0)
    t.share[0], t.lead[0] = 0.5, lead  # 5 misses: round(2.5 + lead), at most all 5
    record = assign(t, [[1, 2], [3, 4], [5, -1]], job=cs.CpuJob.allocate(4, 2, 4, pin=False))
    assert (record[1] == cs.ON_CPU).sum() == 5 - streamed
    assert record[1, :streamed].ne(cs.ON_CPU).all() and record[1, streamed:5].eq(cs.ON_CPU).all()


def test_cpu_mode_sends_every_miss_to_the_cpu_and_padding_nowhere() -> None:
    t = tables()
    t.share[0] = 0.0
    job = cs.CpuJob.allocate(2, 2, 4, pin=False)
    hit = int((t.state[0] >= 0).nonzero()[0, 0])
    miss = next(e for e in range(E) if t.state[0, e] < 0)
    record = assign(t, [[hit, miss], [-1, -1]], landing=False, job=job)
    assert record[1].tolist() == [cs.HIT, cs.ON_CPU, cs.PAD, cs.PAD]
    assert job.on_cpu[:4].tolist() == [0, 1, 0, 0] and job.expert_ids[:4].tolist() == [hit, miss, -1, -1]


def test_begin_step_publishes_landings_and_applies_the_hosts_changes() -> None:
    t = tables(layers=2, cached=0)
    record = torch.full((4, 3, 2), -1, dtype=torch.int32)  # [pairs, 3, layers]
    record[:3, :, 1] = torch.tensor([[7, 8, 9], [cs.LANDED, cs.STAGED, cs.LANDED], [103, -1, 104]]).T
    record[3, :, 0] = torch.tensor([6, cs.LANDED, 105])  # beyond the previous step's pairs: ignored
    changes = torch.tensor([[cs.PUBLISH, 0, 2, 5], [cs.UNPUBLISH, 1, 11, 0], [cs.OFFER, 0, 9, 77],
                            [cs.TAIL, 0, 10, 0], [cs.PUBLISH, 0, 3, 6]])
    t.state[1, 11] = 1
    cs.begin_step_torch(t, record, torch.tensor([4, 3]), changes)
    assert int(t.state[1, 7]) == 103 and int(t.state[1, 9]) == 104 and int(t.state[1, 8]) == -1
    assert int(t.state[0, 6]) == -1
    assert int(t.state[0, 2]) == 5 and int(t.state[1, 11]) == -1 and int(t.state[0, 3]) == -1  # 4 of 5 changes
    assert t.cur[0, :, 2].tolist() == (t.pool_base[0] + 5 * t.pool_stride[0]).tolist()
    assert int(t.ring[0, 9 % 8]) == 77 and int(t.tail[0]) == 10


# --- the kernels against the references --------------------------------------------------------------------


def random_step(seed: int, device: torch.device) -> None:
    g = torch.Generator().manual_seed(seed)
    base = tables(layers=4, rings=2, capacity=12, seed=seed, cached=5)
    base.head.copy_(torch.tensor([3, 9]))
    base.tail.copy_(torch.tensor([6, 20]))
    base.share.copy_(torch.tensor([1.0, 0.5, 0.0, 0.25]))
    base.lead.copy_(torch.tensor([0.0, 0.0, 0.0, 1.2]))
    on = lambda t: t.to(device)  # noqa: E731
    # the ring's inline PTX runs on CUDA only (not the interpreter); the bells live across the layers
    bell_ref, bell_fused = (cs.Bell.allocate(d) for d in (torch.device("cpu"), device)) if device.type == "cuda" \
        else (None, None)
    for tokens, row, landing in itertools.product((1, int(torch.randint(2, 9, (1,), generator=g))), range(4),
                                                  (True, False)):
        top_k = 4
        ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)])
        ids[torch.rand(ids.shape, generator=g) < 0.1] = -1
        weights, x = torch.rand(tokens, top_k, generator=g), torch.randn(tokens, 32, generator=g)
        ref, fused = clone(base), on_device(base, on)
        rec_ref = torch.zeros(40, 3, 4, dtype=torch.int32)[:, :, row]  # a layer's strided part
        rec_fused = on(torch.zeros(40, 3, 4, dtype=torch.int32))[:, :, row]
        job_ref = cs.CpuJob.allocate(8, top_k, 32, pin=False, bell=bell_ref)
        job_fused = cs.CpuJob.allocate(8, top_k, 32, pin=device.type == "cuda", bell=bell_fused)
        cs.assign_experts_torch(row, ids, weights, x, ref, rec_ref, landing, job_ref)
        from ops.triton.cache_step import assign_experts
        from ops.triton.prepare import launch_prepare, written_bytes
        from ops.triton.tables import QType
        prepared = assign_experts(row, on(ids), on(weights), on(x), fused, rec_fused, landing, job_fused,
                                  prepare=QType.Q8_0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        alone, alone_sums = launch_prepare(on(x), QType.Q8_0)
        assert prepared is not None and torch.equal(prepared.sums, alone_sums) and torch.equal(
            written_bytes(prepared.x, QType.Q8_0), written_bytes(alone, QType.Q8_0)), "x prepared beside the assignment"
        used = ids[ids >= 0].unique()
        for name in ("state", "cur", "head", "tail", "ring"):
            assert torch.equal(getattr(ref, name), getattr(fused, name).cpu()), (name, row, landing)
        assert torch.equal(ref.fill[row, used], fused.fill[row, used].cpu())
        assert torch.equal(rec_ref, rec_fused.cpu()), (row, landing)
        for f in ("x", "expert_ids", "weights", "on_cpu", "num_tokens"):
            assert torch.equal(getattr(job_ref, f), getattr(job_fused, f)), f
        if bell_ref is not None and bell_fused is not None:
            assert torch.equal(bell_ref.state, bell_fused.state.cpu()), (row, landing)
            assert int(bell_ref.words[cs.Bell.RING]) == int(bell_fused.words[cs.Bell.RING]), (row, landing)
    record = torch.randint(-1, 4, (32, 3, 4), generator=g, dtype=torch.int32)
    record[:, 0] = torch.stack([torch.randperm(E, generator=g).repeat(2) for _ in range(4)]).T
    record[E:, 1][record[E:, 1] == cs.LANDED] = cs.HIT  # an expert lands once a step: its misses are deduped
    changes = torch.tensor([[0, 1, 3, 40], [1, 2, 5, 0], [2, 1, 13, 77], [3, 1, 14, 0], [0, 3, 9, 11], [9] * 4])
    # NOTE: the host never changes an expert that landed in the previous step (it has not seen that step):
    # the kernel applies both at once, in no order
    for kind, row, expert, _ in changes[:5].tolist():
        if kind in (cs.PUBLISH, cs.UNPUBLISH):
            record[:, 1, row][record[:, 0, row] == expert] = cs.STAGED
    header = torch.tensor([5, int(torch.randint(0, 33, (1,), generator=g))])
    ref, fused = clone(base), on_device(base, on)
    cs.begin_step_torch(ref, record, header, changes)
    from ops.triton.cache_step import begin_step
    pin = device.type == "cuda"
    begin_step(fused, on(record), header.pin_memory() if pin else header, changes.pin_memory() if pin else changes)
    for name in ("state", "cur", "ring", "tail"):
        assert torch.equal(getattr(ref, name), getattr(fused, name).cpu()), name


def test_a_prompts_record_names_hits_in_their_slots_and_stages_the_rest_without_changing_the_cache() -> None:
    t = tables()
    before = clone(t)
    hit = int((t.state[1] >= 0).nonzero()[0, 0])
    missed = next(e for e in range(E) if t.state[1, e] < 0)
    record = torch.full((8, 3), 99, dtype=torch.int32)
    cs.record_prompt_torch(1, torch.tensor([[hit, missed], [-1, hit]]), t, record)
    assert record[:4].T.tolist() == [[hit, missed, -1, hit], [cs.HIT, cs.STAGED, cs.PAD, cs.HIT],
                                     [int(t.state[1, hit]), -1, -1, int(t.state[1, hit])]]
    assert (record[4:] == 99).all(), "rows past the prompt's pairs are untouched"
    for name in cs.SlotTables.__dataclass_fields__:
        assert torch.equal(getattr(t, name), getattr(before, name)), name


def random_prompt(seed: int, device: torch.device) -> None:
    """The prompt's record kernel against its reference: random routing with padding, a layer's strided record."""
    from ops.triton.cache_step import record_prompt

    g = torch.Generator().manual_seed(seed)
    base = tables(layers=4, seed=seed, cached=int(torch.randint(0, E + 1, (1,), generator=g)))
    for row, tokens in itertools.product(range(4), (3, 700)):
        ids = torch.randint(0, E, (tokens, 4), generator=g)
        ids[torch.rand(ids.shape, generator=g) < 0.1] = -1
        ref = torch.zeros(tokens * 4 + 5, 3, 4, dtype=torch.int32)[:, :, row]
        fused = torch.zeros(tokens * 4 + 5, 3, 4, dtype=torch.int32, device=device)[:, :, row]
        cs.record_prompt_torch(row, ids, base, ref)
        record_prompt(row, ids.to(device), on_device(base, lambda t: t.to(device)), fused)
        assert torch.equal(ref, fused.cpu()), (seed, row, tokens)


@pytest.mark.gpu
def test_kernels_equal_the_references_on_cuda() -> None:
    pytest.importorskip("triton")
    for seed in range(6):
        random_step(seed, torch.device("cuda"))
        random_prompt(seed, torch.device("cuda"))


INTERPRETER_CHECKS = [(f"seed {i}", lambda seed: random_step(seed, torch.device("cpu"))) for i in range(3)] + \
    [(f"prompt seed {i}", lambda seed: random_prompt(seed, torch.device("cpu"))) for i in range(2)]


@needs_no_cuda
def test_kernels_under_the_interpreter() -> None:
    pytest.importorskip("triton", reason="triton is not installed: the GPU kernels need it")
    run_interpreted(__file__, INTERPRETER_CHECKS)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(interpret_main(INTERPRETER_CHECKS))
