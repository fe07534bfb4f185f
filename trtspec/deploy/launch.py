"""Where a trtllm deployment's engines run and how tritonserver is started for them.

Placement: each model's ranks go to GPU ids (`gpu.target_devices` / `gpu.draft_devices`, by default the first
tp x pp GPUs each, so the draft shares the target's first GPU as NVIDIA's DTM README recommends). On a shared GPU the
KV cache is split by the memory plan (trtspec.compile.memory.plan_kv_caches): together the caches take 0.9 of what the
engines leave free (TensorRT-LLM's default fraction), each engine's `max_tokens_in_paged_kv_cache` is its share (the
same multiple of its bare need, max_batch_size sequences at full length, for both), and `kv_cache_free_gpu_mem_fraction`
is set so that this cap, not the fraction, binds whichever engine loads last; the caps sum below the free memory, so
the load order does not matter. Room beyond the bare need is what keeps the orchestrator's sequences reusable between
its calls. An engine alone on its GPUs takes 0.9 of their free memory, as TensorRT-LLM does by default.

Launch, as TensorRT-LLM's scripts/launch_triton_server.py does it:
- one TP1 target and no draft: tritonserver alone;
- a draft, or any model over more than one GPU: orchestrator mode ("--multi-model"): env TRTLLM_ORCHESTRATOR=1 and
  `mpirun -n 1 tritonserver ...` (`--allow-run-as-root` only when running as root); the tensorrtllm backend spawns
  one worker process per GPU of each model (TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1);
- `gpu.fast_logits`: orchestrator mode without spawned processes ("--disable-spawn-processes"): world size
  1 + draft ranks + target ranks, one tritonserver per MPI rank; rank 0 serves everything, ranks >= 1 load only the
  engine models (`--model-control-mode=explicit --load-model=...`) and open no HTTP, gRPC or metrics endpoint
  (WORKER_RANK_ENDPOINTS); `participant_ids` give each model its ranks
  (draft 1..tp_d, target after it) and `speculative_decoding_fast_logits` sends draft logits over MPI.
Every rank gets its own Python-backend shared-memory prefix (`--backend-config=python,shm-region-prefix-name=prefixR_`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trtspec.engine.manifest import EngineInfo

TARGET_MODEL = "tensorrt_llm"
DRAFT_MODEL = "tensorrt_llm_draft"
# In orchestrator mode the executor's receiving thread polls the workers for responses and sleeps this long between
# empty polls; unset, it busy-loops ("recv_poll_period_ms is not set, will use busy loop", model_instance_state.cc;
# the value goes to ExecutorConfig's recvPollPeriodMs), a core per engine model taken from the BLS and the
# tokenizers. 1 ms adds at most that to a response, against decode steps of several ms.
RECV_POLL_PERIOD_MS = 1
# Ranks >= 1 of a launch without spawned workers open no endpoint: every rank runs on this host with the server's
# own arguments, ports included (as launch_triton_server.py, 0a2e2c1f, does). NVIDIA's worker ranks never reach their
# endpoints, held in the tensorrtllm model's load until the orchestrator ends (model_instance_state.cc: shutdown(),
# then exit(0)); a rank that did finish loading would fail to bind rank 0's ports and exit, ending the MPI job.
# Given after the shared arguments, so they win over rank 0's --allow-metrics; the admin restrictions, still there,
# guard nothing on a rank without endpoints.
WORKER_RANK_ENDPOINTS = ("--allow-http=false", "--allow-grpc=false", "--allow-metrics=false")


@dataclass(frozen=True)
class Placement:
    target_devices: list[int]
    draft_devices: list[int] | None
    fast_logits: bool = False

    @property
    def shared(self) -> bool:
        return bool(self.draft_devices) and bool(set(self.target_devices) & set(self.draft_devices))

    @property
    def devices(self) -> list[int]:
        """The GPU ids the deployment uses."""
        return sorted(set(self.target_devices) | set(self.draft_devices or []))

    def participant_ids(self, role: str) -> list[int]:
        """MPI ranks of a model in orchestrator mode without spawned processes (rank 0 is the orchestrator)."""
        draft = list(range(1, 1 + len(self.draft_devices or [])))
        if role == "draft":
            return draft
        start = 1 + len(draft)
        return list(range(start, start + len(self.target_devices)))


def orchestrator_mode(target: EngineInfo, draft: EngineInfo | None) -> bool:
    """A draft, or any model over more than one GPU: launch_triton_server.py's --multi-model."""
    return draft is not None or target.world_size > 1


def placement(config, target: EngineInfo, draft: EngineInfo | None) -> Placement:
    gpu = config.gpu
    target_devices = list(gpu.target_devices or range(target.world_size))
    draft_devices = list(gpu.draft_devices or range(draft.world_size)) if draft is not None else None
    return Placement(target_devices, draft_devices, gpu.fast_logits and draft is not None)


def memory_plan(config, target: EngineInfo, draft: EngineInfo | None, place: Placement | None = None):
    """The built engines' memory plan on the GPUs the build plans against (the machine's, else the config's): each
    engine's KV cap and kv_cache_free_gpu_mem_fraction (trtspec.compile.memory.plan_kv_caches, kv_fractions)."""
    from trtspec.compile.memory import MemoryPlan, built_engine_memory
    from trtspec.environment import available_gpus

    place = place or placement(config, target, draft)
    gpus, source = available_gpus(config)
    engines = [built_engine_memory(role, info, devices) for role, info, devices in _roles(target, draft, place)]
    return MemoryPlan(engines, list(gpus), gpu_source=source)


def kv_cache_sequences(config, target: EngineInfo, draft: EngineInfo | None) -> float | None:
    """How many full-length sequences the target's planned KV cache holds, in units of its max_batch_size (None:
    not a trtllm build)."""
    if config.backend != "trtllm":
        return None
    cap = next(e for e in memory_plan(config, target, draft).engines if e.role == "target")
    return max(cap.kv_cap_tokens, cap.kv_tokens) / cap.kv_tokens


def _roles(target: EngineInfo, draft: EngineInfo | None, place: Placement):
    """(role, engine, GPU ids) of each deployed engine."""
    for role, info, devices in (("target", target, place.target_devices), ("draft", draft, place.draft_devices)):
        if info is not None:
            yield role, info, devices


def planned_gpu_memory_fraction(config, target: EngineInfo, draft: EngineInfo | None) -> float | None:
    """The fraction of its memory the fullest GPU holds in steady use, as planned (None without GPUs to plan on:
    the machine's, else the config's, as the build plans).

    TensorRT-LLM reserves its KV cache when an engine loads: kv_cache_free_gpu_mem_fraction of the memory free after
    the engines' weights, so used memory sits near this level from the first minute and a 92 % alert on it would
    fire forever. Weights per rank are taken as the rank's engine file, plus RUNTIME_OVERHEAD_GIB per engine; the
    KV cap on a shared GPU (max_tokens_in_paged_kv_cache) can keep real use below the plan. An estimate, not a
    measurement."""
    from trtspec.compile.memory import GIB, RUNTIME_OVERHEAD_GIB, TOTAL_KV_FRACTION
    from trtspec.environment import available_gpus

    if config.backend != "trtllm":
        return None
    memory = {g.index: g.memory_gib * GIB for g in available_gpus(config)[0]}
    place = placement(config, target, draft)
    fractions = memory_plan(config, target, draft, place).kv_fractions()
    planned = []
    for device in place.devices:
        if device not in memory:
            continue
        held, kv_fraction = 0.0, 0.0
        for role, info, devices in _roles(target, draft, place):
            if device in devices:
                engine = Path(info.path) / f"rank{devices.index(device)}.engine"
                held += (engine.stat().st_size if engine.is_file() else 0) + RUNTIME_OVERHEAD_GIB * GIB
                kv_fraction += fractions[role]
        # on a shared GPU the caps sum to TOTAL_KV_FRACTION of the free memory (the fractions only keep the cap binding)
        kv_fraction = min(kv_fraction, TOTAL_KV_FRACTION)
        planned.append(1 - (1 - kv_fraction) * (1 - min(held / memory[device], 1.0)))
    return round(max(planned), 4) if planned else None


def engine_model_values(config, target: EngineInfo, draft: EngineInfo | None) -> dict[str, dict]:
    """Per engine model ('target', 'draft'), the tensorrtllm template's placement fields; `extra_parameters`: the
    parameters that apply only to some placements (the repository writes them as parameter lines)."""
    place = placement(config, target, draft)
    plan = memory_plan(config, target, draft, place)
    fractions = plan.kv_fractions()
    caps = {e.role: e.kv_cap_tokens for e in plan.engines}
    values = {}
    for role, _info, devices in _roles(target, draft, place):
        extra = {}
        if place.shared:
            extra["max_tokens_in_paged_kv_cache"] = caps[role]
        if orchestrator_mode(target, draft):
            extra["recv_poll_period_ms"] = RECV_POLL_PERIOD_MS
        if place.fast_logits:
            extra["participant_ids"] = ",".join(map(str, place.participant_ids(role)))
            extra["speculative_decoding_fast_logits"] = "1"
        values[role] = {
            "gpu_device_ids": ",".join(map(str, devices)),
            "kv_cache_free_gpu_mem_fraction": str(fractions[role]),
            "extra_parameters": {k: str(v) for k, v in extra.items()},
        }
    return values


# ---- starting tritonserver ----------------------------------------------------------------------------------


@dataclass
class Launch:
    """How `trtspec serve` starts tritonserver for a repository (recorded in the repository's marker file)."""

    mpi: bool = False
    world_size: int = 1
    spawn_processes: bool = True
    engine_models: list[str] = field(default_factory=list)
    devices: list[int] = field(default_factory=list)  # the GPU ids of the placement

    @property
    def gpus(self) -> int:
        """GPUs the deployment uses (what a Kubernetes pod requests)."""
        return len(self.devices)

    @property
    def env(self) -> dict[str, str]:
        if not self.mpi:
            return {}
        return {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1" if self.spawn_processes else "0"}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> Launch:
        data = dict(data or {})
        if "devices" not in data:  # a marker from before the placement's ids were kept: GPUs 0..gpus-1
            data["devices"] = list(range(int(data.get("gpus", 0))))
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def command(self, server_args: list[str]) -> list[str]:
        """The full command: tritonserver's own args (binary first), wrapped in mpirun when the launch needs MPI."""
        if not self.mpi:
            return list(server_args)
        # OpenMPI refuses to start as root without this flag; as any other user (the container's), it is not needed
        cmd = ["mpirun", *(["--allow-run-as-root"] if os.geteuid() == 0 else [])]
        for rank in range(self.world_size):
            if rank:
                cmd.append(":")
            cmd += ["-n", "1", *server_args]
            if rank:
                cmd.append("--model-control-mode=explicit")
                cmd += [f"--load-model={name}" for name in self.engine_models]
                cmd += list(WORKER_RANK_ENDPOINTS)
            if self.spawn_processes:
                # As launch_triton_server.py --multi-model does for spawned executor workers (Triton > 24.06): the
                # server process itself runs no engine, so it must not reserve pinned or CUDA pool memory on the
                # GPUs that the memory plan gives to the engines' workers.
                cmd += ["--pinned-memory-pool-byte-size=0", "--enable-peer-access=false"]
                cmd += [f"--cuda-memory-pool-byte-size={gpu}:0" for gpu in self.devices or [0]]
            cmd += ["--disable-auto-complete-config", f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"]
        return cmd


def launch_for(config, target: EngineInfo, draft: EngineInfo | None) -> Launch:
    if config.backend != "trtllm":
        return Launch()
    place = placement(config, target, draft)
    models = [TARGET_MODEL] + ([DRAFT_MODEL] if draft is not None else [])
    if not orchestrator_mode(target, draft):
        return Launch(devices=place.devices, engine_models=models)
    world = 1 + target.world_size + (draft.world_size if draft else 0) if place.fast_logits else 1
    return Launch(
        mpi=True, world_size=world, spawn_processes=not place.fast_logits, engine_models=models, devices=place.devices
    )


def repository_launch(repo) -> Launch | None:
    """The launch `trtspec deploy` recorded in a repository's marker file; None: plain tritonserver."""
    from trtspec.marker import read_marker

    marker = read_marker(repo)
    launch = Launch.from_dict(marker.get("launch")) if marker is not None else None
    return launch if launch is not None and launch.mpi else None


def server_command_line(server) -> str:
    """The shell line that starts `server` (trtspec.server.TritonServer): environment, then the command."""
    import shlex

    from trtspec import keys
    from trtspec.server_binary import CONTAINER_BACKENDS, CONTAINER_BINARY, ServerBinary, ServerError, find_tritonserver

    try:
        binary = find_tritonserver(server.binary)
    except ServerError:  # printing for another machine (the container): name its binary
        binary = ServerBinary(
            Path(server.binary) if server.binary else CONTAINER_BINARY, "container", CONTAINER_BACKENDS
        )
    env = {**binary.env_additions, **server.environ_additions()}
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    line = (prefix + " " if prefix else "") + shlex.join(server.command(binary))
    # The keys are read from the environment when the line runs, never printed (keys are URL-safe characters, which
    # shlex leaves unquoted).
    for key, name in ((server.admin_key, keys.ADMIN_ENV), (server.api_key, keys.API_ENV)):
        if key is not None:
            line = line.replace(key.value, f'"${{{name}}}"')
    return line
