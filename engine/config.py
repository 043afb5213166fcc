"""One config tree of frozen dataclasses, built once at the CLI edge and validated on construction;
each component receives only its slice.

A field whose metadata names a `flag` is a command-line option (and a `MOECACHE_*` variable) of the
commands that run an engine, with the field's default and the metadata's `help` (`service/options.py`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ops.kv_quant import KV_CACHE_TYPES

MISS_MODES = ("cpu", "stream", "hybrid")
POLICIES = ("lru", "decay", "lfru", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DENSE_WEIGHTS = ("auto", "q8_0", "dtype")
DECODE_AHEAD = ("auto", "on", "off")
DEVICE_NAME = re.compile(r"cpu|cuda:\d+")  # one entry of --devices


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
    path: str | None = field(default=None, metadata={  # None: the command line's default, the embedded model
        "flag": ("-m", "--model"), "help": "GGUF file (first file of a split model); default: the embedded model"})
    device: str = field(default="auto", metadata={  # auto: cuda when available, else cpu
        "flag": "--device", "help": "cuda, cuda:N or cpu (default: cuda when available)"})
    dtype: str = field(default="auto", metadata={  # auto: bfloat16 on cuda, float32 on cpu
        "flag": "--dtype", "choices": DTYPES, "help": "weights and activations (auto: bfloat16 on cuda, float32 "
        "on cpu)"})
    max_context: int = field(default=4096, metadata={  # capped at the model's own context length
        "flag": ("-c", "--ctx-size"), "help": "context length per sequence"})
    kv_cache_dtype: str = field(default="bf16", metadata={
        "flag": "--kv-cache-dtype", "choices": tuple(KV_CACHE_TYPES), "help": "K and V cache: bf16 (unquantized, "
        "in the activation dtype) or ggml's 8- and 4-bit blocks q8_0, q4_0"})
    cache_type_k: str | None = field(default=None, metadata={  # None: kv_cache_dtype
        "flag": ("-ctk", "--cache-type-k"), "choices": tuple(KV_CACHE_TYPES),
        "help": "K cache type (default: --kv-cache-dtype)"})
    cache_type_v: str | None = field(default=None, metadata={  # None: kv_cache_dtype
        "flag": ("-ctv", "--cache-type-v"), "choices": tuple(KV_CACHE_TYPES),
        "help": "V cache type (default: --kv-cache-dtype)"})
    dense_weights: str = field(default="auto", metadata={  # auto: the output matrix as q8_0 on cuda
        "flag": "--dense-weights", "choices": DENSE_WEIGHTS, "help": "dense matrices (attention, dense and shared "
        "FFNs, output): q8_0 keeps those the file holds as Q8_0 so (half the bytes), dtype dequantizes every one "
        "to --dtype, auto keeps the output matrix as Q8_0 on cuda (its kernel reads it faster than the bf16 "
        "copy; the smaller matrices are faster in bf16)"})
    devices: str | None = field(default=None, metadata={  # None: --device's, or every GPU (`spread_devices`)
        "flag": "--devices", "metavar": "LIST", "help": "several devices of one kind, e.g. cuda:0,cuda:1: the layers "
        "split across them in contiguous ranges, each with its own expert cache (steps that span several CUDA "
        "devices run without CUDA graphs; default: the first GPU where the model fits 90%% of its free memory, "
        "else every visible GPU)"})
    tensor_split: str | None = field(default=None, metadata={  # None: by each device's free memory
        "flag": "--tensor-split", "metavar": "A,B", "help": "shares of the layers each device of --devices takes "
        "(default: in proportion to each device's free memory)"})
    cuda_graphs: bool = True  # decode steps as CUDA graphs where no host sync is needed

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16 (got {self.dtype!r})")
        if self.dense_weights not in DENSE_WEIGHTS:
            raise ValueError(f"dense_weights must be one of {', '.join(DENSE_WEIGHTS)} (got {self.dense_weights!r})")
        if self.max_context < 2:
            raise ValueError("max_context must be at least 2")
        for name in (self.kv_cache_dtype, self.cache_type_k, self.cache_type_v):
            if name is not None and name not in KV_CACHE_TYPES:
                raise ValueError(f"KV cache type must be one of {', '.join(KV_CACHE_TYPES)} (got {name!r})")
        self._check_devices()

    def _check_devices(self) -> None:
        if self.devices is not None:
            if self.device != "auto":
                raise ValueError("give --device or --devices, not both")
            names = self.device_names
            bad = [name for name in names if not DEVICE_NAME.fullmatch(name)]
            if bad or not names:
                raise ValueError(f"--devices takes a comma-separated list of cpu or cuda:N (got {self.devices!r})")
            # NOTE: a device may be named twice: the split's code path on one device (tests)
            if len({name.split(":")[0] for name in names}) > 1:
                raise ValueError(f"--devices are all cuda or all cpu (got {self.devices!r})")
        if self.tensor_split is not None:
            self._check_tensor_split()

    def _check_tensor_split(self) -> None:
        if self.devices is None:
            raise ValueError("--tensor-split shares the layers between the devices of --devices: give --devices")
        try:
            shares = self.split_shares or ()
        except ValueError:
            raise ValueError(f"--tensor-split takes comma-separated numbers (got {self.tensor_split!r})") from None
        if len(shares) != len(self.device_names):
            raise ValueError(f"--tensor-split has {len(shares)} shares for {len(self.device_names)} devices "
                             f"(got {self.tensor_split!r})")
        if not all(share > 0 and math.isfinite(share) for share in shares):
            raise ValueError(f"--tensor-split shares must be positive numbers (got {self.tensor_split!r})")

    @property
    def device_names(self) -> tuple[str, ...]:
        """--devices as a tuple; the one --device (maybe `auto`) without it."""
        if self.devices is None:
            return (self.device,)
        return tuple(name.strip() for name in self.devices.split(","))

    @property
    def split_shares(self) -> tuple[float, ...] | None:
        """--tensor-split as numbers; None without it."""
        if self.tensor_split is None:
            return None
        return tuple(float(share) for share in self.tensor_split.split(","))

    @property
    def kv_types(self) -> tuple[str, str]:
        """The K and V cache types."""
        return self.cache_type_k or self.kv_cache_dtype, self.cache_type_v or self.kv_cache_dtype


@dataclass(frozen=True)
class CacheConfig:
    policy: str = field(default="decay", metadata={"flag": "--cache-policy", "choices": POLICIES})
    miss_mode: str = field(default="cpu", metadata={
        "flag": "--miss-mode", "choices": MISS_MODES,
        "help": "where cache misses are computed: cpu, stream (device reads host memory) or hybrid"})
    budget_mib: int | None = field(default=None, metadata={  # None: automatic
        "flag": "--moe-cache-mib", "metavar": "MIB",
        "help": "GPU expert cache budget (default: the free device memory after weights, KV cache and headroom)"})
    cpu_moe: bool = field(default=False, metadata={  # every routed expert in host RAM
        "flag": "--cpu-moe", "help": "keep every routed expert in host RAM"})
    n_cpu_moe: int = field(default=0, metadata={  # the first N MoE layers' experts in host RAM
        "flag": "--n-cpu-moe", "metavar": "N", "help": "routed experts of the first N MoE layers in host RAM"})
    ssd_moe: bool = field(default=False, metadata={  # every host layer's routed experts read from the GGUF file
        "flag": "--ssd-moe", "help": "keep every routed expert on disk (the GGUF file) behind a bounded host-RAM "
        "tier: only the experts a step selects are read"})
    n_ssd_moe: int = field(default=0, metadata={  # the first N MoE layers' experts on disk
        "flag": "--n-ssd-moe", "metavar": "N", "help": "routed experts of the first N MoE layers on disk behind the "
        "host-RAM tier"})
    host_cache_mib: int | None = field(default=None, metadata={  # None: half the available RAM at start-up
        "flag": "--host-cache-mib", "metavar": "MIB", "help": "host-RAM tier of --ssd-moe/--n-ssd-moe (default: half "
        "the available RAM at start-up)"})
    promote_per_step: int = field(default=8, metadata={
        "flag": "--cache-promote-per-step", "metavar": "N",
        "help": "uploads a step where misses do not land (cpu miss mode; decay and lfru)"})
    free_slots: int = field(default=0, metadata={  # 0: from the ring's recent misses
        "flag": "--cache-free-slots", "metavar": "N",
        "help": "free slots each ring of the cache offers to landing misses (0: twice its recent misses)"})
    link_gbps: float | None = field(default=None, metadata={  # None: the machine's own link
        "flag": "--link-gbps", "metavar": "GB/S",
        "help": "simulate a slower host -> device link (benchmarks): every expert copy is held to this rate"})
    max_cached_batch: int = 32  # larger batches (prefill) stage experts instead of using the cache
    headroom_mib: int = field(default=1024, metadata={
        "flag": "--cache-headroom-mib", "metavar": "MIB", "help": "device memory the automatic budget leaves free"})
    cpu_threads: int | None = field(default=None, metadata={
        "flag": "--cpu-threads", "metavar": "N", "help": "threads computing experts on the CPU (default: the cores)"})
    profile_in: str | None = field(default=None, metadata={
        "flag": "--cache-profile", "metavar": "FILE", "help": "warm-start the cache from a profile"})
    profile_out: str | None = field(default=None, metadata={
        "flag": "--cache-profile-out", "metavar": "FILE", "help": "save a profile of expert use"})
    record_trace: str | None = field(default=None, metadata={
        "flag": "--record-trace", "metavar": "FILE", "help": "record the routing of every step"})

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"cache policy must be one of {', '.join(POLICIES)} (got {self.policy!r})")
        MissMode(self.miss_mode)
        if self.budget_mib is not None and self.budget_mib < 0:
            raise ValueError("cache budget must be >= 0 MiB")
        if self.link_gbps is not None and not self.link_gbps > 0:
            raise ValueError(f"--link-gbps must be > 0 (got {self.link_gbps})")
        if self.n_cpu_moe < 0 or self.promote_per_step < 1 or self.max_cached_batch < 1 or self.free_slots < 0:
            raise ValueError("n_cpu_moe >= 0, promote_per_step >= 1, max_cached_batch >= 1 and free_slots >= 0 "
                             "are required")
        if self.n_ssd_moe < 0:
            raise ValueError(f"--n-ssd-moe must be >= 0 (got {self.n_ssd_moe})")
        if self.ssd_moe and self.n_ssd_moe:
            raise ValueError("give --ssd-moe (every MoE layer) or --n-ssd-moe N (the first N), not both")
        if self.host_cache_mib is not None and not self.uses_disk:
            raise ValueError("--host-cache-mib sizes the host-RAM tier of --ssd-moe or --n-ssd-moe: give one of them")
        if self.host_cache_mib is not None and self.host_cache_mib < 1:
            raise ValueError(f"--host-cache-mib must be >= 1 MiB (got {self.host_cache_mib})")

    @property
    def mode(self) -> MissMode:
        return MissMode(self.miss_mode)

    @property
    def uses_disk(self) -> bool:
        """Some routed experts stay on disk behind the host-RAM tier."""
        return self.ssd_moe or self.n_ssd_moe > 0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=32, metadata={  # KV slots = sequences decoding at once
        "flag": "--max-num-seqs", "help": "sequences decoded together"})
    max_num_batched_tokens: int = field(default=512, metadata={  # decode tokens + prefill chunks
        "flag": "--max-batch-tokens", "help": "tokens in one forward pass"})
    # NOTE: a step that prefills beside running decodes delays their next tokens by the whole step, and that step's
    # cost is mostly fixed: beside 32 decoding streams, a step of up to 128 prompt tokens took 74-76 ms where a
    # 512-token prompt alone takes 82 ms (Qwen3-30B-A3B shapes, H100, docs/benchmarks.md, fourth lease of
    # 2026-12-06), and where routed experts live in host RAM a prompt's step stages those layers whatever its size.
    # So by default a step prefills up to its budget: the fewest steps that stall the streams.
    prefill_while_decoding: int = field(default=0, metadata={
        "flag": "--prefill-while-decoding", "metavar": "TOKENS", "help": "at most this many prompt tokens a step "
        "prefills beside running decodes, which wait for it (default 0: up to --max-batch-tokens)"})
    decode_ahead: str = field(default="auto", metadata={
        "flag": "--decode-ahead", "choices": DECODE_AHEAD, "help": "launch the next decode step, fed the sampled "
        "tokens on the device, before the last step's tokens reach the host, so that the host's work of a step "
        "runs while the device computes the next (auto: on CUDA with CUDA graphs where every routed expert is "
        "resident; on: wherever every routed expert is resident)"})
    max_model_len: int = 4096  # positions of one KV slot
    max_waiting: int = 256

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs")
        if self.prefill_while_decoding < 0:
            raise ValueError("prefill_while_decoding must be >= 0")
        if self.decode_ahead not in DECODE_AHEAD:
            raise ValueError(f"decode_ahead must be one of {', '.join(DECODE_AHEAD)} (got {self.decode_ahead!r})")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
