"""One config tree of frozen dataclasses, built once at the CLI edge and validated on construction;
each component receives only its slice."""

from __future__ import annotations

from dataclasses import dataclass, field

MISS_MODES = ("cpu", "stream", "hybrid")
POLICIES = ("lru", "decay", "lfru", "static")


@dataclass(frozen=True)
class MissMode:
    """Where the experts a step misses in the cache are computed: `cpu` (the CPU, from host RAM),
    `stream` (the device, copying them from pinned host memory), `hybrid` (split between the two)."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in MISS_MODES:
            raise ValueError(f"miss mode must be one of {', '.join(MISS_MODES)} (got {self.name!r})")

    @property
    def streams(self) -> bool:
        """The device copies some misses over PCIe (and they can land in the cache)."""
        return self.name != "cpu"

    @property
    def uses_cpu(self) -> bool:
        """The CPU computes some misses."""
        return self.name != "stream"


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # None: the embedded default model
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    max_context: int = 4096  # capped at the model's own context length
    cuda_graphs: bool = True  # decode steps as CUDA graphs where no host sync is needed

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16 (got {self.dtype!r})")
        if self.max_context < 2:
            raise ValueError("max_context must be at least 2")


@dataclass(frozen=True)
class CacheConfig:
    policy: str = "lru"
    miss_mode: str = "cpu"
    budget_mib: int | None = None  # None: automatic (free device memory minus KV, workspace, headroom)
    cpu_moe: bool = False  # every routed expert in host RAM
    n_cpu_moe: int = 0  # the first N MoE layers' experts in host RAM
    promote_per_step: int = 8  # uploads a step where misses do not land (cpu miss mode), decay and lfru
    free_slots: int = 0  # offered slots a ring of the cache keeps for landing misses; 0: from recent misses
    max_cached_batch: int = 32  # larger batches (prefill) stage experts instead of using the cache
    headroom_mib: int = 1024
    cpu_threads: int | None = None
    profile_in: str | None = None
    profile_out: str | None = None
    record_trace: str | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"cache policy must be one of {', '.join(POLICIES)} (got {self.policy!r})")
        MissMode(self.miss_mode)
        if self.budget_mib is not None and self.budget_mib < 0:
            raise ValueError("cache budget must be >= 0 MiB")
        if self.n_cpu_moe < 0 or self.promote_per_step < 1 or self.max_cached_batch < 1 or self.free_slots < 0:
            raise ValueError("n_cpu_moe >= 0, promote_per_step >= 1, max_cached_batch >= 1 and free_slots >= 0 "
                             "are required")

    @property
    def mode(self) -> MissMode:
        return MissMode(self.miss_mode)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32  # KV slots = sequences decoding at once
    max_num_batched_tokens: int = 512  # tokens in one forward pass (decode tokens + prefill chunks)
    max_model_len: int = 4096  # positions of one KV slot
    max_waiting: int = 256

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    routing: str = "model"  # "model" | "trace:FILE" | "synthetic:qwen3" | "synthetic:mixtral" (benchmarks)
