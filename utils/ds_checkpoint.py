"""DeepSpeed checkpoints that survive a crash mid-write and load without unpickling code.

DeepSpeed 0.19 writes each checkpoint file with a plain torch.save (a kill mid-write leaves half a
file under the real name), writes the `latest` tag file with a plain open/write, and loads with
weights_only=False (a checkpoint file can run code). Here:
- every file goes through utils.log.atomic_write (temporary file, fsync, rename);
- `latest` is written by rank 0 only after every rank's files of the new tag are complete
  (save_checkpoint ends with a barrier), also atomically: a crash at any moment leaves `latest`
  naming a complete checkpoint;
- files load with weights_only=True, with the few plain DeepSpeed classes a checkpoint holds
  allowlisted.
"""
import os
from pathlib import Path

import torch
from deepspeed.checkpoint.constants import (
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
)
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from utils.log import atomic_write


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


def use_safe_checkpoints(engine):
    """[8] Replace the engine's checkpoint writer/reader (it is created in deepspeed.initialize)."""
    engine.checkpoint_engine = SafeCheckpointEngine(engine._config)


def save(engine, folder, tag, client_state, is_main):
    """A collective: every rank writes its files of `tag`; then rank 0 points `latest` at it.
    `universal_checkpoint_info` is what DeepSpeed's converter to a universal checkpoint
    (ds_to_universal, for another world size) requires of ZeRO-1 and -2 files: it is the client's
    to write, and without it the conversion stops with an assertion."""
    client_state = {**client_state, UNIVERSAL_CHECKPOINT_INFO: {
        UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
    engine.save_checkpoint(folder, tag=tag, client_state=client_state, save_latest=False)
    if is_main:
        atomic_write(os.path.join(folder, "latest"), lambda f: f.write(tag))


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


def fp32_weights(engine):
    """The model's weights as one plain fp32 state dict on the CPU (at ZeRO-3 call it inside
    deepspeed.zero.GatheredParameters: each rank holds only 1/N of every parameter)."""
    return {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}
