#!/usr/bin/env python
"""MNIST with Horovod and TensorFlow 2 (custom training loop, Keras 3 model, tf.function).

Runs as one process, or as N under horovodrun (gloo or MPI controller) or a plain MPI launcher:
    python horovod/tensorflow/main.py
    horovodrun -np 2 --gloo python horovod/tensorflow/main.py
    mpiexec -n 2 python horovod/tensorflow/main.py
The numbered comments ([hvd N]) are Horovod's recipe; horovod/README.md explains each step.
For Horovod's Keras API (model.fit + callbacks) see keras_main.py beside this file.
"""
import sys
import time
from pathlib import Path

# The repo root goes *after* site-packages, so our horovod/ folder never shadows the installed library.
sys.path.append(str(Path(__file__).resolve().parents[2]))
from utils import data, dist, log  # noqa: E402
from utils.parse_args import get_parser, parse, positive_float  # noqa: E402
from utils.schedule import lr_at, scaled_lr  # noqa: E402
from utils.tf_utils import (build_model, checksum, configure_tf, images, restore_latest,  # noqa: E402
                            shard_dataset)

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

FRAMEWORK = "horovod-tensorflow"


def horovod_flags(parser):
    g = parser.add_argument_group("horovod")
    g.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to fp16 for the all-reduce")
    g.add_argument("--use-adasum", action="store_true", help="combine gradients with Adasum instead of averaging")
    g.add_argument("--gradient-predivide-factor", type=positive_float, default=1.0,
                   help="divide gradients by this before the sum and by size/factor after")
    return parser


def tf_variables(keras_variables):
    """Keras 3 wraps each tf.Variable in a keras.Variable, which Horovod 0.28 does not understand
    ("'Variable' object has no attribute 'ref'", horovod#4290). Hand Horovod the tf.Variable inside."""
    return [v.value for v in keras_variables]


def all_sum(values, env):
    """[hvd 7] Sum a few numbers over all ranks (metrics), so every rank reports the global value."""
    return hvd.allreduce(tf.constant(values, tf.float64), op=hvd.Sum, name="metrics").numpy().tolist()


def all_max(value, env):
    return float(hvd.allreduce(tf.constant([value], tf.float64), op=hvd.Max, name="max").numpy()[0])


def make_train_step(model, optimizer, args):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        # [hvd 5] the tape all-reduces (averages) each gradient across ranks when it is computed
        tape = hvd.DistributedGradientTape(tape, compression=compression,
                                           op=hvd.Adasum if args.use_adasum else hvd.Average,
                                           gradient_predivide_factor=args.gradient_predivide_factor)
        grads = tape.gradient(loss, tf_variables(model.trainable_variables))
        optimizer.apply_gradients(zip(grads, model.trainable_variables))  # [hvd 6] identical update everywhere
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=y.dtype), y), tf.float64))
        return loss, correct
    return train_step


def train_epoch(train_step, optimizer, dataset, num_steps, epoch, lr_of_step, env, args):
    loss_sum, correct, seen = 0.0, 0.0, 0
    progress = log.Progress(env.is_main, num_steps, epoch, args.log_interval)
    for step, (x, y) in enumerate(dataset):
        optimizer.learning_rate.assign(lr_of_step(step))
        loss, step_correct = train_step(x, y)
        loss_sum += float(loss) * len(y)
        correct += float(step_correct)
        seen += len(y)
        progress.update(step + 1, float(loss))
    progress.close()
    return loss_sum, correct, seen


def evaluate(model, x, y, indices, batch_size):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    loss_sum, correct = 0.0, 0
    for start in range(0, len(indices), batch_size):
        idx = indices[start:start + batch_size]
        logits = model(x[idx], training=False)
        loss_sum += float(loss_fn(y[idx], logits))
        correct += int((logits.numpy().argmax(1) == y[idx]).sum())
    return loss_sum, correct, len(indices)


def main():
    args = parse(horovod_flags(get_parser(__doc__)))
    if args.grad_accum != 1:
        raise log.UserError("--grad-accum is implemented in the PyTorch examples only")
    wall_start = time.perf_counter()

    # --- set up distributed ----------------------------------------------------------------------
    launcher = dist.discover()
    # Horovod reads its knobs at init: on CPU a longer cycle time (utils/dist.py; README, Performance)
    knobs = dist.horovod_knobs(on_cpu=args.device == "cpu" or not tf.config.list_physical_devices("GPU"),
                               dist_timeout=args.dist_timeout)
    hvd.init()  # [hvd 1] start Horovod: rank, size and local rank come from horovodrun or MPI
    env = dist.DistEnv(hvd.rank(), hvd.local_rank(), hvd.size(), hvd.local_size(), launcher.launcher,
                       backend="horovod-" + ("mpi" if hvd.mpi_enabled() else "gloo"))
    env.num_threads = dist.threads_per_rank(args.num_threads, env.local_world_size)
    env.device = configure_tf(args.device, env.local_rank, env.num_threads)  # [hvd 2] one GPU per process
    log.configure(env.rank, args.log_all_ranks)
    if args.use_adasum and not hvd.mpi_enabled():
        raise log.UserError("--use-adasum needs the MPI controller (mpiexec, horovodrun --mpi): gloo has no Adasum")
    log_dir = args.log_dir or hvd.broadcast_object(log.default_log_dir("horovod-tensorflow"), root_rank=0)
    run = log.RunLog(log_dir, env.is_main)
    log.info(f"{FRAMEWORK}: {env.world_size} rank(s) via {env.launcher}, device {env.device}, "
             f"{env.backend} controller, {env.num_threads} thread(s) per rank, "
             f"HOROVOD_CYCLE_TIME {knobs['HOROVOD_CYCLE_TIME']}")

    # --- data: every rank loads the set, then trains on its own shard -----------------------------
    mnist = data.load_mnist(args.data_dir, args.download, env.is_main,
                            barrier=lambda: hvd.broadcast_object(None, root_rank=0))  # hvd.tensorflow has no barrier
    log.info(mnist.describe())
    x_train, y_train, x_test, y_test = images(mnist.x_train), mnist.y_train, images(mnist.x_test), mnist.y_test
    test_idx = data.test_shard(len(y_test), env.rank, env.world_size)

    # --- model and optimizer ---------------------------------------------------------------------
    keras.utils.set_random_seed(args.seed)
    model = build_model(keras, args.dropout)
    # [hvd 3] scale the LR by the number of workers (Adasum adapts to the gradients instead: no scaling)
    lr = scaled_lr(args.lr, env.world_size, not (args.no_lr_scaling or args.use_adasum))
    optimizer = keras.optimizers.SGD(learning_rate=lr, momentum=args.momentum)
    optimizer.build(model.trainable_variables)  # create the momentum slots now, so they can be broadcast
    epoch_var = tf.Variable(0, dtype=tf.int64)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, epoch=epoch_var)
    manager = tf.train.CheckpointManager(checkpoint, args.checkpoint_dir or str(Path(log_dir) / "checkpoints"),
                                         max_to_keep=2)
    if args.resume and env.is_main:  # rank 0 restores; the broadcast below hands the state to everyone
        restored = restore_latest(checkpoint, manager)  # one line on stderr if it is missing or does not fit
        log.info(f"resumed from {restored}: continuing at epoch {int(epoch_var) + 1}")
    first_epoch = hvd.broadcast_object(int(epoch_var), root_rank=0) + 1
    run.keep_epochs_before(first_epoch)
    # [hvd 4] start every rank from rank 0's weights and optimizer state. Horovod's own TF2 example does this
    # after the first step, because Keras 2 created optimizer slots lazily; built up front, we can do it first.
    hvd.broadcast_variables(tf_variables(model.variables), root_rank=0)
    hvd.broadcast_variables(tf_variables(optimizer.variables), root_rank=0)
    train_step = make_train_step(model, optimizer, args)
    run.write_config(args, env.as_dict(), FRAMEWORK, {"log_dir": log_dir, "scaled_lr": lr,
                                                 "horovod_knobs": knobs})

    # --- train / evaluate ------------------------------------------------------------------------
    for epoch in range(first_epoch, args.epochs + 1):
        keras.utils.set_random_seed(args.seed + 1000 * epoch + env.rank)  # dropout masks, reproducible on resume
        # [hvd 0] shard by the *global* rank (the original workshop script used the local rank: wrong on >1 node)
        steps = data.epoch_batches(len(y_train), args.batch_size, env.rank, env.world_size,
                                   args.seed, epoch, args.max_steps)
        dataset = shard_dataset(x_train, y_train, steps, args.batch_size)

        def lr_of_step(step):
            return lr_at(epoch - 1 + step / len(steps), args.lr, lr, args.lr_warmup_epochs)

        start = time.perf_counter()
        train = train_epoch(train_step, optimizer, dataset, len(steps), epoch, lr_of_step, env, args)
        train_time = all_max(time.perf_counter() - start, env)
        test = evaluate(model, x_test, y_test, test_idx, args.test_batch_size)
        run.epoch_end(epoch, all_sum(train + test, env), float(optimizer.learning_rate.numpy()),
                      time.perf_counter() - start, train_time, env, FRAMEWORK)
        epoch_var.assign(epoch)
        if env.is_main:  # one writer; TensorFlow writes to temporary files and renames
            manager.save()

    # --- summary ---------------------------------------------------------------------------------
    checksums = hvd.allgather_object(checksum(model.variables))  # identical on every rank, or something broke
    if args.save_model and env.is_main:
        model.save_weights(str(Path(log_dir) / "model.weights.h5"))
    run.summary({"wall_time_s": time.perf_counter() - wall_start, "param_checksums": checksums,
                 "device": env.device, "world_size": env.world_size, "launcher": env.launcher,
                 "framework": FRAMEWORK})
    hvd.shutdown()


if __name__ == "__main__":
    log.run_main(main)
