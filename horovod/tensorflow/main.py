#!/usr/bin/env python
"""MNIST with Horovod and TensorFlow 2 (a custom loop); [1]-[8]: the recipe (README.md explains).

    python horovod/tensorflow/main.py                           one process
    horovodrun -np 2 --gloo python horovod/tensorflow/main.py   two ranks
    mpiexec -n 2 python horovod/tensorflow/main.py              two ranks, Horovod over MPI
"""
import hashlib
import os
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the repo root *after* site-packages
try:  # course plumbing, no step of the recipe (course/plumbing.py): the libraries' noise filtered,
    from course import plumbing  # flags checked, every ending one line. A copy runs without it.
except ImportError:
    plumbing = None

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from utils import data, log  # the course's helpers: MNIST, and rank 0's lines and run files
from utils.parse_args import get_parser, positive_float

CPU_KNOBS = {"HOROVOD_CYCLE_TIME": "5"}  # ms between Horovod's rounds (default 1): CPU ranks
ONE_THREAD = tf.data.Options()  # tf.data's own thread pool would compete with the ranks for cores
ONE_THREAD.threading.private_threadpool_size = 1
ONE_THREAD.autotune.enabled = False


def horovod_flags(parser):
    g = parser.add_argument_group("horovod").add_argument
    g("--fp16-allreduce", action="store_true", help="compress gradients to fp16 for the all-reduce")
    g("--use-adasum", action="store_true", help="combine gradients with Adasum, not the average")
    g("--gradient-predivide-factor", type=positive_float, default=1.0, help="divide gradients by "
      "this before the sum and by size/factor after (numerics of big worlds)")
    return parser


def Net(dropout):  # pytorch/examples' MNIST CNN in Keras; outputs logits
    L = keras.layers
    return keras.Sequential([keras.Input((28, 28, 1)), L.Conv2D(32, 3, activation="relu"),
                             L.Conv2D(64, 3, activation="relu"), L.MaxPooling2D(2),
                             L.Dropout(dropout), L.Flatten(), L.Dense(128, activation="relu"),
                             L.Dropout(2 * dropout), L.Dense(10)])


def shard(x, y, epoch, steps, args):  # [3] the same shuffle on every rank, then its own shard by
    # *global* rank (not the local rank: it repeats on every node); `steps` batches on every rank
    dataset = (tf.data.Dataset.from_tensor_slices((x, y))
               .shuffle(len(y), seed=args.seed + epoch, reshuffle_each_iteration=False)
               .shard(num_shards=hvd.size(), index=hvd.rank())
               .batch(args.batch_size, drop_remainder=True).take(steps).prefetch(2))
    return dataset.with_options(ONE_THREAD)


def make_train_step(model, optimizer, args):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        # [6] gradients averaged: the tape all-reduces each gradient across ranks as it computes it
        tape = hvd.DistributedGradientTape(tape, compression=compression,
                                           op=hvd.Adasum if args.use_adasum else hvd.Average,
                                           gradient_predivide_factor=args.gradient_predivide_factor)
        # Keras 3 wraps each tf.Variable: Horovod 0.28 needs them bare (v.value, horovod#4290)
        grads = tape.gradient(loss, [v.value for v in model.trainable_variables])
        optimizer.apply_gradients(zip(grads, model.trainable_variables))  # the same on every rank
        hits = tf.argmax(logits, 1, output_type=y.dtype) == y
        return loss, tf.reduce_sum(tf.cast(hits, tf.float64))
    return train_step


def train_epoch(train_step, optimizer, dataset, steps, epoch, lr, args):
    sums = [0.0, 0.0, 0]  # loss, correct, seen
    progress = log.Progress(hvd.rank() == 0, steps, epoch, args.log_interval)
    for step, (x, y) in enumerate(dataset):
        p, W = epoch - 1 + step / steps, args.lr_warmup_epochs  # W epochs of warmup: linear
        optimizer.learning_rate.assign(args.lr + (lr - args.lr) * p / W if W and p < W else lr)
        loss, correct = train_step(x, y)
        sums = [sums[0] + float(loss) * len(y), sums[1] + float(correct), sums[2] + len(y)]
        progress.update(step + 1, float(loss))
    return sums


def evaluate(model, dataset):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    sums = [0.0, 0, 0]
    for x, y in dataset:
        logits = model(x, training=False)
        sums = [sums[0] + float(loss_fn(y, logits)),
                sums[1] + int((logits.numpy().argmax(1) == y.numpy()).sum()), sums[2] + len(y)]
    return sums


def main(args):
    if args.grad_accum != 1 or args.device == "xpu":  # (Horovod TensorFlow is not on Aurora)
        sys.exit("error: --grad-accum, --device xpu: not in this lesson; on Intel GPUs (Aurora) "
                 "use DDP/main.py")
    gpus = tf.config.list_physical_devices("GPU") if args.device != "cpu" else []
    if args.device == "cuda" and not gpus:
        sys.exit("error: --device cuda: TensorFlow sees no GPU; use --device cpu or auto")
    for name, value in ({} if gpus else CPU_KNOBS).items():  # read by hvd.init(): set them first
        os.environ.setdefault(name, value)
    os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(args.dist_timeout))  # gloo's ops
    # [1] Start Horovod: rank, local rank and size come from horovodrun or the MPI launcher.
    hvd.init()
    e, rank, size = os.environ, hvd.rank(), hvd.size()  # the launcher's name, for the logs:
    launcher = ("horovodrun" if "HOROVOD_RANK" in e else "python" if size == 1 else "srun" if
                "SLURM_STEP_ID" in e and "MPI_LOCALRANKID" not in e else "mpiexec")
    controller = "horovod-" + ("mpi" if hvd.mpi_enabled() else "gloo")
    if args.use_adasum and not hvd.mpi_enabled():
        sys.exit("error: --use-adasum needs the MPI controller (mpiexec, horovodrun --mpi): "
                 "gloo has no Adasum")
    # [2] Pin this rank to one GPU: only GPU number = local rank stays visible. CPUs: its threads.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # all of them if the launcher bound this rank to its own cores, else a share
    threads = args.num_threads or (cores if cores < os.cpu_count() else
                                   cores // hvd.local_size() or 1)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    mine = [gpus[hvd.local_rank() % len(gpus)]] if gpus else []  # this rank's GPU; CPUs: none
    tf.config.set_visible_devices(mine, "GPU")
    for gpu in mine:
        tf.config.experimental.set_memory_growth(gpu, True)
    log.configure(rank, hvd.local_rank(), args.log_all_ranks)
    log_dir = args.log_dir or hvd.broadcast_object(log.default_log_dir("horovod-tensorflow"))
    run = log.RunLog(log_dir, rank == 0)
    mnist = data.load_mnist(args.data_dir, args.download, rank == 0,  # hvd.tensorflow: no barrier
                            barrier=lambda: hvd.broadcast_object(None, root_rank=0))
    knobs = {name: os.environ.get(name, "Horovod's default") for name in CPU_KNOBS}
    device = f"gpu:{hvd.local_rank() % len(gpus)}" if gpus else "cpu"
    log.info(f"horovod-tensorflow: {size} rank(s) via {launcher}, device {device}, {controller} "
             f"controller, {threads} thread(s) per rank, HOROVOD_CYCLE_TIME "
             f"{knobs['HOROVOD_CYCLE_TIME']}\n{mnist.describe()}")
    x_train, y_train = data.normalized(mnist.x_train)[..., None], mnist.y_train
    test_set = tf.data.Dataset.from_tensor_slices(  # [3] sharded too
        (data.normalized(mnist.x_test)[..., None], mnist.y_test)).shard(size, rank)
    test_set = test_set.batch(args.test_batch_size).with_options(ONE_THREAD)
    steps = data.batches_per_rank(len(y_train), size, args.batch_size, args.max_steps)
    keras.utils.set_random_seed(args.seed)
    model = Net(args.dropout)
    # [4] Scale the LR with the global batch (Adasum adapts to the gradients instead: no scaling).
    lr = args.lr if args.no_lr_scaling or args.use_adasum else args.lr * size
    optimizer = keras.optimizers.SGD(learning_rate=lr, momentum=args.momentum)
    optimizer.build(model.trainable_variables)  # the momentum slots now, so that [5] can send them
    epoch_var = tf.Variable(0, dtype=tf.int64)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, epoch=epoch_var)
    folder = str(log.checkpoint_folder(args.checkpoint_dir, log_dir))
    manager = tf.train.CheckpointManager(checkpoint, folder, max_to_keep=2)
    if args.resume and manager.latest_checkpoint and rank == 0:  # [8] rank 0 restores; [5] sends
        checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
        log.info(f"resumed from {manager.latest_checkpoint}: continuing at epoch "
                 f"{int(epoch_var) + 1}")
    first_epoch = hvd.broadcast_object(int(epoch_var), root_rank=0) + 1
    run.keep_epochs_before(first_epoch)
    # [5] Start every rank from rank 0's weights and optimizer state (Horovod's TF2 example does it
    #     after the first step: Keras 2 made optimizer slots lazily; built up front, we can first).
    hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
    hvd.broadcast_variables([v.value for v in optimizer.variables], root_rank=0)
    train_step = make_train_step(model, optimizer, args)
    run.write_config(args, dict(rank=rank, local_rank=hvd.local_rank(), world_size=size,
                                local_world_size=hvd.local_size(), launcher=launcher,
                                device=device, backend=controller, num_threads=threads,
                                log_dir=log_dir, scaled_lr=lr, horovod_knobs=knobs),
                     "horovod-tensorflow")
    for epoch in range(first_epoch, args.epochs + 1):
        # dropout: Keras 3 draws from seed generators no checkpoint keeps (resumed = uninterrupted
        # exactly only with --dropout 0)
        keras.utils.set_random_seed(args.seed + 1000 * epoch + rank)
        dataset = shard(x_train, y_train, epoch, steps, args)  # [3] a new shuffle each epoch
        start = time.perf_counter()
        train = train_epoch(train_step, optimizer, dataset, steps, epoch, lr, args)
        seconds = tf.constant(time.perf_counter() - start, tf.float64)
        train_time = float(hvd.allreduce(seconds, op=hvd.Max, name="time"))  # the slowest rank's
        sums = tf.constant(train + evaluate(model, test_set), tf.float64)
        sums = hvd.allreduce(sums, op=hvd.Sum, name="metrics")  # [7] metrics summed over ranks
        run.epoch_end(epoch, sums.numpy().tolist(), float(optimizer.learning_rate.numpy()),
                      time.perf_counter() - start, train_time)
        epoch_var.assign(epoch)
        if rank == 0:  # [8] one writer; TensorFlow writes to temporary files and renames
            manager.save()
    weights = np.concatenate([np.asarray(v.numpy(), np.float32).ravel() for v in model.variables])
    checksums = hvd.allgather_object(hashlib.sha256(weights.tobytes()).hexdigest()[:16])
    if args.save_model and rank == 0:  # all checksums equal, or something broke
        model.save_weights(str(Path(log_dir) / "model.weights.h5"))
    run.summary({"param_checksums": checksums, "device": device})
    hvd.shutdown()  # Horovod's background thread joined: the interpreter's teardown finds it gone


if __name__ == "__main__":
    parser = horovod_flags(get_parser(__doc__, backend=False))
    if plumbing:
        plumbing.run_main(main, parser)
    else:
        main(parser.parse_args())
