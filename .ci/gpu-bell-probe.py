"""The CPU tasks' doorbell as a decode step uses it (CUDA): the device waits for a ring's answer with k experts of
one token on the CPU (`CpuTasks.device_seconds`), then 48 layers of 65 us of device work each followed by a ring
and its wait. Prints the step's time and the cost a layer adds. Usage: python3 .ci/gpu-bell-probe.py THREADS"""
import sys

import torch

from engine.expert_cache.cpu_tasks import CpuTasks
from ops.bank import ExpertWeights, random_expert_weights
from ops.quants import QType
from ops.triton import hold
from ops.triton.bell import ring_and_wait

threads = int(sys.argv[1])
dev = torch.device("cuda")
NB = 8
banks = {}
for layer in range(NB):
    w = random_expert_weights(128, 2048, 768, QType.Q4_K)
    banks[layer] = ExpertWeights(w.gate.pin_memory(), w.up.pin_memory(), w.down.pin_memory(), w.gate_type, w.up_type,
                             w.down_type, w.hidden, w.ff)
tasks = CpuTasks(banks, {layer: layer for layer in range(NB)}, 1, 8, 2048, dev, threads)
assert tasks.rings
for k in (1, 2, 4, 8):
    print(f"threads {threads}: device_seconds k={k}: {tasks.device_seconds(0, k)*1e6:.1f} us", flush=True)
job = tasks.job
job.num_tokens[0] = 1
job.x[0] = torch.randn(2048)
job.weights[:] = 1.0
main = torch.cuda.current_stream()
g = torch.Generator().manual_seed(0)
for k in (1, 2, 4):
    pre_us = 65
    ids = torch.stack([torch.randperm(128, generator=g)[:8].to(torch.int32) for _ in range(48 * 20)]).to(dev)
    oncpu = torch.tensor([1] * k + [0] * (8 - k), dtype=torch.int32, device=dev)
    times = []
    for rep in range(20):
        torch.cuda.synchronize()
        hold(300_000, dev)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(main)
        for layer in range(48):
            hold(pre_us * 1000, dev)
            job.expert_ids.copy_(ids[rep * 48 + layer], non_blocking=True)
            job.on_cpu.copy_(oncpu, non_blocking=True)
            ring_and_wait(job.bell, layer % NB)
        e.record(main)
        e.synchronize()
        times.append(s.elapsed_time(e))
    med = sorted(times)[10]
    base = 48 * pre_us / 1e3
    added = (med - base) / 48 * 1e3
    print(f"threads {threads} k={k}: step {med:.3f} ms, device {base:.3f} ms, +{added:.1f} us a layer "
          f"({added / k:.1f} us an expert)", flush=True)
w = tasks.work()
print(f"work: calls {w.calls} experts {w.experts} busy {w.busy_seconds:.3f} s -> {w.gbps:.1f} GB/s, "
      f"{w.busy_seconds / max(w.experts, 1) * 1e6:.1f} us an expert busy", flush=True)
tasks.close()
