"""The machine under the ranks, for the plumbing, diagnose/ and the tools (each lesson writes its own
step [2]): the one check of --device and of --backend, the cores a rank may use, Horovod's CPU knobs,
and where DeepSpeed's JIT-built ops are cached. Who the ranks are: course/ranks.py."""
import os
import sys


def device_problem(device):
    """What is wrong with --device `device` here, as one line (cuda or xpu where torch sees none),
    or None: the one check of the flag, by course/checks.py's parse() (each lesson's step [2] then
    picks the device itself)."""
    import torch
    module = getattr(torch, device, None)
    if device in ("cuda", "xpu") and not (module is not None and module.is_available()):
        return (f"--device {device}: this torch ({torch.__version__}) sees no {device} device "
                f"(torch.{device}.is_available() is False); use --device cpu or auto")
    return None


def cores():
    """(the cores this process may use, whether the launcher bound it to them)."""
    has_affinity = hasattr(os, "sched_getaffinity")
    allowed = len(os.sched_getaffinity(0)) if has_affinity else os.cpu_count()
    return allowed, allowed < (os.cpu_count() or allowed)


def warn_shared_cores(env):
    """More ranks on this node than cores, unbound: said once, by local rank 0 (`env`:
    course/ranks.py's discover())."""
    allowed, bound = cores()
    if not bound and env.local_world_size > allowed and env.local_rank == 0:
        sys.stderr.write(f"warning: {env.local_world_size} ranks on the {allowed} core(s) of this "
                         "node: ranks share cores, so steps are slower than with one rank per "
                         "core\n")


# Horovod's background thread wakes every HOROVOD_CYCLE_TIME ms (Horovod's default: 1) to agree with
# the other ranks on which tensors are ready: a small collective each time, 1,000 a second per rank.
# On GPU nodes it has a core to itself; on CPU ranks it takes that time from the compute thread of a
# core it shares. `make bench` measures this choice against Horovod's default in every run (README,
# Performance).
HOROVOD_CPU_KNOBS = {"HOROVOD_CYCLE_TIME": "5"}


def horovod_knobs(on_cpu, dist_timeout=None):
    """Before hvd.init(): the course's Horovod settings for CPU ranks, unless the environment sets
    them.

    `dist_timeout` (--dist-timeout) becomes HOROVOD_GLOO_TIMEOUT_SECONDS, the timeout of every gloo
    operation Horovod runs (its default: 30 s), so the flag bounds a hung peer in the Horovod
    examples as it does in the torch.distributed ones. `horovodrun --gloo-timeout-seconds N` sets
    the variable itself and wins."""
    if on_cpu:
        for name, value in HOROVOD_CPU_KNOBS.items():
            os.environ.setdefault(name, value)
    if dist_timeout:
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(dist_timeout))
    return {name: os.environ.get(name, "Horovod's default") for name in HOROVOD_CPU_KNOBS}


# The vendor collective libraries and the one device kind each connects.
GPU_BACKENDS = {"nccl": "cuda", "xccl": "xpu"}


def backend_problem(backend, device):
    """What is wrong with --backend `backend` for `device`, as one line, or None: the one check of
    the flag, by course/checks.py's parse() before any process group, with --device (`auto` until
    a rank picks one; each lesson's step [1] then picks the backend itself)."""
    if backend == "auto":
        return None
    import torch
    import torch.distributed as dist
    if not getattr(dist, f"is_{backend}_available", lambda: True)():
        return (f"--backend {backend}: this torch build has no {backend} backend "
                f"(torch {torch.__version__}); use --backend auto")
    kind, wants = device.split(":")[0], GPU_BACKENDS.get(backend)
    seen = getattr(getattr(torch, wants or "cpu", None), "is_available", bool)
    if wants and kind == "auto" and not seen():
        return (f"--backend {backend} connects {wants} devices and torch sees none here; "
                "use --backend auto")
    if wants and kind not in ("auto", wants):
        return f"--backend {backend} connects {wants} devices, not {device}; use --backend auto"
    if backend == "gloo" and kind == "xpu":
        return "--backend gloo cannot move xpu tensors; use --backend xccl (or auto)"
    return None


def default_extensions_dir():
    """DeepSpeed's JIT-built ops go to a cache outside the checkout (where `make setup` puts
    them), one folder per Python environment: a build records its environment's paths, and a run
    from another environment (a second clone's venv) would rebuild it over the first one's."""
    import hashlib
    home_cache = os.path.join(os.path.expanduser("~"), ".cache", "scaling-dl")
    cache = os.environ.get("SCALING_DL_CACHE", home_cache)
    env_id = hashlib.sha1(sys.prefix.encode()).hexdigest()[:8]
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(cache, "torch_extensions", env_id))
