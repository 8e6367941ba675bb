"""Course plumbing for deepspeed/main.py, from outside: plumbing.run_main checks the flags with it,
and course/wrap.py's deepspeed.initialize checks the config and guards the engine with it. A copy of
the lesson runs without it, with DeepSpeed's own behaviour.

- deepspeed.initialize checks the config first. DeepSpeed silently ignores a top-level key it does
  not know (a misspelt "train_bach_size" changes nothing) and reports most other mistakes with an
  assertion deep inside; here each is one `error:` line on every rank, before the engine is built.
- The engine it returns writes its checkpoint files atomically and loads them with
  weights_only=True: DeepSpeed 0.19 writes each file with a plain torch.save (a kill mid-write
  leaves half a file under the real name) and loads with weights_only=False (a file can run code).
  A checkpoint that does not load is one line, which says how to convert it for another world size.
- The process groups DeepSpeed makes itself get --dist-timeout (torch's default: 30 minutes).
- Its JIT-built ops (cpu_adam, for --offload) are cached outside the checkout (course/dist.py).
"""
import json
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.config import DeepSpeedConfig

from course.errors import fail
from utils.log import atomic_write


def check_flags(args):
    """Before the lesson's main(args): its DeepSpeed flags and JSON file checked. Returns the
    file's path (None for zero/main.py, whose config is in the lesson: nothing is wrapped)."""
    if not hasattr(args, "deepspeed_config"):  # zero/main.py: its config is in the file
        return None
    path = args.deepspeed_config
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        fail(f"DeepSpeed config {path}: {exc}")
    if not isinstance(config, dict):
        fail(f"DeepSpeed config {path}: expected a JSON object")
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if args.offload and (stage if args.zero_stage is None else args.zero_stage) == 0:
        fail("--offload needs ZeRO stage 1, 2 or 3 (add --zero-stage 2)")
    if args.load_universal and not args.resume:
        fail("--load-universal says what --resume loads: add --resume")
    return path


def guard(engine):
    """The engine deepspeed.initialize returned, writing its checkpoints atomically and loading them
    safely: a checkpoint that does not load is one line (course/wrap.py calls this)."""
    engine.checkpoint_engine = SafeCheckpointEngine(engine._config)
    load = engine.load_checkpoint

    def load_checkpoint(folder, *a, **k):
        try:
            return load(folder, *a, **k)
        except Exception as exc:  # truncated, or of another model / stage / world size
            fail(not_loaded(folder, exc))
    engine.load_checkpoint = load_checkpoint
    return engine


def check(config, path, world_size=None):
    """Refuse a config DeepSpeed would reject with a traceback, or silently ignore (a misspelt key).
    """
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    total, micro = config.get("train_batch_size"), config.get("train_micro_batch_size_per_gpu")
    if total is not None:
        if not isinstance(total, int) or total <= 0 or total % world_size:
            fail(f"DeepSpeed config {path}: train_batch_size {total} is not divisible by the "
                 f"{world_size} ranks (it is the global batch: micro batch x accumulation steps "
                 f"x ranks)")
        if isinstance(micro, int) and micro > 0 and (total // world_size) % micro:
            fail(f"DeepSpeed config {path}: train_batch_size {total} / {world_size} ranks = "
                 f"{total // world_size} per rank, not a multiple of the micro batch {micro}")
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


def _allowed_globals():
    """Classes a DeepSpeed checkpoint of this course's configs holds besides tensors and plain
    containers: found with torch.serialization.get_unsafe_globals_in_checkpoint on stage 0-3
    (+ offload) checkpoints."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, ZeroStageEnum, fragment_address]


class SafeCheckpointEngine(TorchCheckpointEngine):
    def save(self, state_dict, path):
        atomic_write(path, lambda f: torch.save(state_dict, f), mode="wb")

    def load(self, path, map_location=None):
        with torch.serialization.safe_globals(_allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)


def not_loaded(checkpoint, exc):
    """The one line for a checkpoint that DeepSpeed's load_checkpoint refused. ZeRO's partitions
    belong to the ranks that wrote them, so another world size refuses them too: the line then says
    how to convert them once into a universal checkpoint, which any world size loads."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    line = f"--resume: checkpoint in {checkpoint} does not load: {reason}"
    latest = Path(checkpoint) / "latest"
    if "world size" in reason and latest.is_file():
        tag, universal = latest.read_text().strip(), Path(checkpoint).parent / "universal"
        line += (f" Convert it once: python -m deepspeed.checkpoint.ds_to_universal --input_folder"
                 f" {Path(checkpoint) / tag} --output_folder {universal / tag}, then add"
                 f" --checkpoint-dir {universal} --load-universal (deepspeed/README.md)")
    return line
