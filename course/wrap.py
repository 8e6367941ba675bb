"""Course plumbing: the framework calls the plumbing must watch, wrapped here and nowhere else. This
is the one module that replaces another module's attributes (tests/test_house.py holds every other
to that); plumbing.run_main calls attach() once the lesson has imported its frameworks.

- torch.distributed.init_process_group (also where device meshes call it): c10d's connection noise
  dropped while a rank joins (quiet.py); once joined, the rank's position kept in the store, to
  name a stuck rank (beacon.py);
- horovod's hvd.init (torch, TensorFlow, Keras): the same position kept, once joined;
- deepspeed.initialize: deepspeed/main.py's config checked first; the engine's checkpoints written
  atomically and loaded safely (ds_guard.py);
- c10d.default_pg_timeout: --dist-timeout, also for the process groups DeepSpeed makes itself;
- tf.train.CheckpointManager.save: the SHA-256 of the checkpoints it keeps (seal.py).
"""
import contextlib
import functools
import sys
from datetime import timedelta

from course import beacon, quiet, seal


def attach(args, deepspeed_config=None):
    """Every wrap above that applies: the frameworks the lesson imported. `deepspeed_config`:
    deepspeed/main.py's JSON file (ds_guard.check_flags), to check before the engine is built."""
    if dist := sys.modules.get("torch.distributed"):
        c10d = sys.modules["torch.distributed.distributed_c10d"]  # (device meshes call it there)
        _watch_joining(dist, "init_process_group", lambda: (dist.get_rank(), dist.get_world_size()),
                       quiet.C10D_CONNECT_NOISE, also=[c10d])
    for name in ("horovod.torch", "horovod.tensorflow", "horovod.tensorflow.keras"):
        if hvd := sys.modules.get(name):
            _watch_joining(hvd, "init", lambda hvd=hvd: (hvd.rank(), hvd.size()))
    if tf := sys.modules.get("tensorflow"):
        _seal_saves(tf.train.CheckpointManager)
    if "deepspeed" in sys.modules:
        group_timeout(timedelta(seconds=args.dist_timeout))  # also the groups DeepSpeed makes
        if deepspeed_config is not None:
            _guard_initialize(sys.modules["deepspeed"], deepspeed_config)


def _watch_joining(module, name, rank_and_size, noise=None, also=()):
    """module.<name> (torch.distributed.init_process_group, hvd.init), wherever it is called from
    (a lesson, DeepSpeed, a device mesh): the stderr lines matching `noise` dropped while it runs,
    unless COURSE_VERBOSE (c10d's C++ frame dumps while a rank finds no rank 0: course/failures.py
    says so in one line), and once joined the rank's position kept in the store (course/beacon.py).
    `also`: other modules that hold the same function under the same name."""
    join = getattr(module, name)
    if getattr(join, "watched", False):
        return

    @functools.wraps(join)
    def watched(*args, **kwargs):
        quiet_now = noise and not quiet.verbose()
        with quiet.filtered_stderr(noise) if quiet_now else contextlib.nullcontext():
            result = join(*args, **kwargs)
        beacon.start(*rank_and_size())
        return result
    watched.watched = True
    for owner in (module, *also):
        setattr(owner, name, watched)


def _guard_initialize(deepspeed, path):
    """deepspeed.initialize: the config it is given checked first (course/ds_guard.py), and the
    engine it returns guarded (atomic writes, safe loads, a refused checkpoint in one line)."""
    from course import ds_guard
    initialize = deepspeed.initialize
    if getattr(initialize, "watched", False):
        return

    def checked_initialize(*a, config=None, **k):
        if isinstance(config, dict):
            ds_guard.check(config, path)
        out = initialize(*a, config=config, **k)
        ds_guard.guard(out[0])
        return out
    checked_initialize.watched = True
    deepspeed.initialize = checked_initialize


def _seal_saves(manager_class):
    """tf.train.CheckpointManager.save (horovod/tensorflow/main.py's [8]), then the SHA-256 of the
    checkpoints it keeps, checked before --resume restores anything (course/seal.py)."""
    save = manager_class.save
    if getattr(save, "watched", False):
        return

    @functools.wraps(save)
    def sealed_save(self, *args, **kwargs):
        path = save(self, *args, **kwargs)
        seal.seal_tensorflow(self.directory)
        return path
    sealed_save.watched = True
    manager_class.save = sealed_save


def group_timeout(timeout):
    """Make `timeout` the default of every process group, also those a library creates itself with
    dist.new_group() and no timeout (DeepSpeed's data-parallel group): torch's default there is 30
    minutes, so a hung peer would hold the job that long. (torch reads these module defaults when a
    group is made.)"""
    import torch.distributed.distributed_c10d as c10d
    c10d.default_pg_timeout = timeout
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timeout
