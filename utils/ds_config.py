"""The DeepSpeed config of deepspeed/main.py: read the JSON file, apply the common flags, and check
it.

DeepSpeed silently ignores a top-level key it does not know (a misspelt "train_bach_size" changes
nothing), and reports most other mistakes with an assertion deep inside deepspeed.initialize. Here
each becomes one `error: ...` line on every rank, before the engine is built.
"""
import json
from dataclasses import dataclass

from utils.errors import fail


@dataclass(frozen=True)
class Loaded:
    """What deepspeed/main.py trains with: the checked config and what it decides for the data loop.
    """
    config: dict  # for deepspeed.initialize(config=...)
    path: str  # the file it came from
    batch_size: int  # micro-batch per rank
    grad_accum: int  # micro-batches per optimizer step
    stage: int  # zero_optimization.stage


def load(args, world_size, default_path):
    """The JSON file + the flags, checked (one `error:` line otherwise). Needs the world size. The
    flags in `args` stay as the user gave them; the data loop reads batch_size and grad_accum here.
    """
    config, path = read(args, world_size, default_path)
    check(config, path)
    batch_size = config["train_micro_batch_size_per_gpu"]
    grad_accum = args.grad_accum
    if "train_batch_size" in config:
        grad_accum = config["train_batch_size"] // (world_size * batch_size)
    stage = config.get("zero_optimization", {}).get("stage", 0)
    return Loaded(config, str(path), batch_size, grad_accum, stage)


def read(args, world_size, default_path):
    """The JSON file + what the common flags decide (batch, accumulation, stage, offload)."""
    path = args.deepspeed_config or default_path
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        fail(f"DeepSpeed config {path}: {exc}")
    if not isinstance(config, dict):
        fail(f"DeepSpeed config {path}: expected a JSON object")
    config.setdefault("train_micro_batch_size_per_gpu", args.batch_size)
    if "train_batch_size" not in config:
        config.setdefault("gradient_accumulation_steps", args.grad_accum)
    micro = config["train_micro_batch_size_per_gpu"]
    if "train_batch_size" in config:
        total = config["train_batch_size"]
        if not isinstance(total, int) or total <= 0 or total % world_size:
            fail(f"DeepSpeed config {path}: train_batch_size {total} is not divisible by the "
                 f"{world_size} ranks (it is the global batch: micro batch x accumulation steps "
                 f"x ranks)")
        if isinstance(micro, int) and micro > 0 and (total // world_size) % micro:
            fail(f"DeepSpeed config {path}: train_batch_size {total} / {world_size} ranks = "
                 f"{total // world_size} per rank, not a multiple of the micro batch {micro}")
    zero = config.setdefault("zero_optimization", {})
    if args.zero_stage is not None:
        zero["stage"] = args.zero_stage
    if args.offload:
        if zero.get("stage", 0) == 0:
            fail("--offload needs ZeRO stage 1, 2 or 3 (add --zero-stage 2)")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        # ZeRO-Offload is built for DeepSpeedCPUAdam (vectorised C++ Adam, the JIT op cpu_adam);
        # with "torch_adam" DeepSpeed would run torch's slower Adam on the CPU partitions instead.
        config.get("optimizer", {}).get("params", {}).pop("torch_adam", None)
    if getattr(args, "load_universal", False) and not args.resume:
        fail("--load-universal says what --resume loads: add --resume")
    if getattr(args, "load_universal", False):  # what --resume loads: a universal checkpoint
        config.setdefault("checkpoint", {})["load_universal"] = True
    needs_norm = args.offload or args.zero_stage not in (None, 1, 2)
    if zero.get("compute_grad_norm") is False and needs_norm:
        # The shipped file skips the gradient norm (below); DeepSpeed needs it at stages 0 and 3 and
        # with offload, and the flags win over the file: the norm comes back.
        del zero["compute_grad_norm"]
    return config, path


def norm_needed(ds):
    """Why DeepSpeed needs the global gradient norm that this (parsed) config skips; None if it may
    skip it. The shipped file skips it (`compute_grad_norm: false`): with clipping off nothing reads
    it (what skipping it saves is within this machine's run-to-run noise: README, Performance).
    DeepSpeed's parser refuses the skip outside stages 1-2; these cases it refuses only later, with
    a traceback from deepspeed.initialize."""
    from deepspeed.runtime.config import DtypeEnum
    if ds.zero_config.compute_grad_norm:
        return None
    offload = ds.zero_config.offload_optimizer
    if offload is not None and offload.device != "none":
        return "ZeRO-Offload needs the norm"
    if (ds.gradient_clipping or 0) > 0:  # DeepSpeed's default clips to 1.0
        return ("gradient_clipping needs the norm (DeepSpeed clips to 1.0 unless the config sets "
                "0.0)")
    if (ds.zero_optimization_stage == 1 and ds.bfloat16_config.enabled
            and ds.grad_accum_dtype is not None
            and DtypeEnum(ds.grad_accum_dtype) == DtypeEnum.fp32):
        return "ZeRO-1 with bf16 and fp32 gradient accumulation needs the norm"
    return None


class _Recorder(dict):
    """A dict that remembers which keys were looked up: the keys DeepSpeed never asks for are
    unknown to it."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.__dict__["seen"] = set()

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def keys(self):
        recorder, base = self, super().keys()

        class Keys:
            def __contains__(self, key):
                recorder.seen.add(key)
                return key in base

            def __iter__(self):
                return iter(base)

            def __len__(self):
                return len(base)
        return Keys()


def check(config, path):
    """Refuse a config DeepSpeed would reject with a traceback, or silently ignore (a misspelt key).
    """
    from deepspeed.runtime.config import DeepSpeedConfig
    recorder = _Recorder(config)
    try:
        parsed = DeepSpeedConfig(recorder)
    except Exception as exc:
        errors = getattr(exc, "errors", None)
        if callable(errors):  # pydantic: an unknown or mistyped key inside a section
            detail = "; ".join(f"{exc.title}.{'.'.join(map(str, e['loc']))}: {e['msg']}"
                               for e in errors())
        else:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        fail(f"DeepSpeed config {path}: {detail}")
    unknown = sorted(set(config) - recorder.seen)
    if unknown:
        fail(f"DeepSpeed config {path}: unknown key(s) {', '.join(unknown)} "
             "(DeepSpeed would ignore them)")
    refused = norm_needed(parsed)
    if refused:
        fail(f"DeepSpeed config {path}: zero_optimization.compute_grad_norm false, but {refused}")
