#!/usr/bin/env python
"""MNIST with Horovod and TensorFlow 2 (custom training loop, Keras 3 model, tf.function).

    python horovod/tensorflow/main.py                           one process
    horovodrun -np 2 --gloo python horovod/tensorflow/main.py   two ranks
    mpiexec -n 2 python horovod/tensorflow/main.py              two ranks, Horovod over MPI

[1]-[8]: the recipe (horovod/tensorflow/README.md explains). Keras' model.fit: keras_main.py.
"""
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the repo root *after* site-packages
import utils

utils.course_output()  # course plumbing: a missing framework is one line; noise filtered

import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from utils import checks, data, failures, log
from utils import dist as course  # which variables each launcher sets; Horovod's CPU knobs
from utils.errors import UserError
from utils.framework_flags import horovod_flags
from utils.parse_args import get_parser
from utils.schedule import lr_at, scaled_lr
from utils.tf_utils import build_model, checksum, configure_tf, images, one_thread, restore_latest

FRAMEWORK = "horovod-tensorflow"


def tf_variables(keras_variables):  # Keras 3 wraps each tf.Variable: Horovod 0.28 needs it bare
    return [v.value for v in keras_variables]  # ("no attribute 'ref'", horovod#4290)


def shard(x, y, epoch, args):
    """[3] This rank's batches of one epoch: every rank shuffles with the same seed, then takes its
    own shard by *global* rank (hvd.rank(), not the local rank: that repeats on every node). Every
    rank runs as many steps (a rank with an extra step would wait forever in an all-reduce the
    others never join)."""
    steps = len(y) // hvd.size() // args.batch_size
    if steps == 0:
        raise data.DataError(f"{len(y)} training samples are too few for {hvd.size()} ranks x "
                             f"batch {args.batch_size}: lower --batch-size or the ranks")
    steps = min(steps, args.max_steps or steps)
    dataset = (tf.data.Dataset.from_tensor_slices((x, y))
               .shuffle(len(y), seed=args.seed + epoch, reshuffle_each_iteration=False)
               .shard(num_shards=hvd.size(), index=hvd.rank())
               .batch(args.batch_size, drop_remainder=True).take(steps).prefetch(2))
    return one_thread(dataset), steps


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
        grads = tape.gradient(loss, tf_variables(model.trainable_variables))
        optimizer.apply_gradients(zip(grads, model.trainable_variables))  # the same on every rank
        hits = tf.equal(tf.argmax(logits, 1, output_type=y.dtype), y)
        correct = tf.reduce_sum(tf.cast(hits, tf.float64))
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
    return loss_sum, correct, seen


def evaluate(model, dataset):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    loss_sum, correct, seen = 0.0, 0, 0
    for x, y in dataset:
        logits = model(x, training=False)
        loss_sum += float(loss_fn(y, logits))
        correct += int((logits.numpy().argmax(1) == y.numpy()).sum())
        seen += len(y)
    return [loss_sum, correct, seen]


def main():
    args = checks.parse(horovod_flags(get_parser(__doc__, backend=False)))
    if checks.finished_already(args):  # --resume auto on a run that is done: touch nothing
        return
    if args.grad_accum != 1:
        raise UserError("--grad-accum is implemented in the PyTorch examples only")
    wall_start = time.perf_counter()

    # --- set up distributed ----------------------------------------------------------------------
    # Horovod reads its knobs at init: on CPU ranks a longer cycle time (utils/dist.py says why)
    on_cpu = args.device == "cpu" or not tf.config.list_physical_devices("GPU")
    knobs = course.horovod_knobs(on_cpu=on_cpu, dist_timeout=args.dist_timeout)
    # [1] Start Horovod: rank, local rank and size come from horovodrun or the MPI launcher.
    hvd.init()
    num_threads = course.threads_per_rank(args.num_threads, hvd.local_size())
    # [2] Pin this rank to one device: only GPU number hvd.local_rank() stays visible (CPU: threads)
    device = configure_tf(args.device, hvd.local_rank(), num_threads)
    controller = "horovod-" + ("mpi" if hvd.mpi_enabled() else "gloo")
    env = course.DistEnv(hvd.rank(), hvd.local_rank(), hvd.size(), hvd.local_size(),
                         course.discover().launcher, device=device, backend=controller,
                         num_threads=num_threads)
    log.configure(env.rank, env.local_rank, args.log_all_ranks)
    if args.use_adasum and not hvd.mpi_enabled():
        raise UserError("--use-adasum needs the MPI controller (mpiexec, horovodrun --mpi): "
                            "gloo has no Adasum")
    log_dir = args.log_dir or hvd.broadcast_object(log.default_log_dir("horovod-tensorflow"),
                                                   root_rank=0)
    run = log.RunLog(log_dir, env.is_main)
    log.info(f"{FRAMEWORK}: {env.world_size} rank(s) via {env.launcher}, device {env.device}, "
             f"{env.backend} controller, {env.num_threads} thread(s) per rank, "
             f"HOROVOD_CYCLE_TIME {knobs['HOROVOD_CYCLE_TIME']}")

    # --- data: every rank loads the set, then trains on its own shard -----------------------------
    mnist = data.load_mnist(args.data_dir, args.download, env.is_main,  # hvd.tensorflow: no barrier
                            barrier=lambda: hvd.broadcast_object(None, root_rank=0))
    log.info(mnist.describe())
    x_train, y_train = images(mnist.x_train), mnist.y_train
    x_test, y_test = images(mnist.x_test), mnist.y_test
    test_set = one_thread(tf.data.Dataset.from_tensor_slices((x_test, y_test))  # [3] sharded too
                          .shard(hvd.size(), hvd.rank()).batch(args.test_batch_size))

    # --- model and optimizer ---------------------------------------------------------------------
    keras.utils.set_random_seed(args.seed)
    model = build_model(keras, args.dropout)
    # [4] Scale the LR with the global batch (Adasum adapts to the gradients instead: no scaling).
    lr = scaled_lr(args.lr, hvd.size(), not (args.no_lr_scaling or args.use_adasum))
    optimizer = keras.optimizers.SGD(learning_rate=lr, momentum=args.momentum)
    optimizer.build(model.trainable_variables)  # the momentum slots now, so that [5] can send them
    epoch_var = tf.Variable(0, dtype=tf.int64)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, epoch=epoch_var)
    folder = str(log.checkpoint_folder(args.checkpoint_dir, log_dir))
    manager = tf.train.CheckpointManager(checkpoint, folder, max_to_keep=2)
    if checks.resuming(args) and env.is_main:  # [8] rank 0 restores; [5] sends it to every rank
        restored = restore_latest(checkpoint, manager)  # one line if it is missing or does not fit
        log.info(f"resumed from {restored}: continuing at epoch {int(epoch_var) + 1}")
    first_epoch = hvd.broadcast_object(int(epoch_var), root_rank=0) + 1
    run.keep_epochs_before(first_epoch)
    # [5] Start every rank from rank 0's weights and optimizer state (Horovod's TF2 example does it
    #     after the first step: Keras 2 made optimizer slots lazily; built up front, we can first).
    hvd.broadcast_variables(tf_variables(model.variables), root_rank=0)
    hvd.broadcast_variables(tf_variables(optimizer.variables), root_rank=0)
    train_step = make_train_step(model, optimizer, args)
    run.write_config(args, env.as_dict(), FRAMEWORK, {"log_dir": log_dir, "scaled_lr": lr,
                                                 "horovod_knobs": knobs})

    # --- train / evaluate ------------------------------------------------------------------------
    for epoch in range(first_epoch, args.epochs + 1):
        # Reseeded each epoch; Keras 3's dropout layers draw from seed generators no checkpoint
        # records: a resumed run repeats an uninterrupted one exactly only with --dropout 0.
        keras.utils.set_random_seed(args.seed + 1000 * epoch + env.rank)
        # [3] a new shuffle each epoch, the same on every rank
        dataset, steps = shard(x_train, y_train, epoch, args)

        def lr_of_step(step):  # --lr-warmup-epochs: linear from the base LR to the scaled one
            return lr_at(epoch - 1 + step / steps, args.lr, lr, args.lr_warmup_epochs)

        start = time.perf_counter()
        train = train_epoch(train_step, optimizer, dataset, steps, epoch, lr_of_step, env, args)
        seconds = tf.constant(time.perf_counter() - start, tf.float64)
        train_time = float(hvd.allreduce(seconds, op=hvd.Max, name="time"))  # the slowest rank's
        sums = tf.constant(list(train) + evaluate(model, test_set), tf.float64)
        sums = hvd.allreduce(sums, op=hvd.Sum, name="metrics")  # [7] metrics summed over ranks
        run.epoch_end(epoch, sums.numpy().tolist(), float(optimizer.learning_rate.numpy()),
                      time.perf_counter() - start, train_time)
        epoch_var.assign(epoch)
        if env.is_main:  # [8] one writer; TensorFlow writes to temporary files and renames
            manager.save()

    # --- summary ---------------------------------------------------------------------------------
    checksums = hvd.allgather_object(checksum(model.variables))  # all equal, or something broke
    if args.save_model and env.is_main:
        model.save_weights(str(Path(log_dir) / "model.weights.h5"))
    run.summary({"wall_time_s": time.perf_counter() - wall_start, "param_checksums": checksums,
                 "device": env.device, "world_size": env.world_size, "launcher": env.launcher,
                 "framework": FRAMEWORK})
    hvd.shutdown()


if __name__ == "__main__":
    failures.run_main(main)  # course plumbing: each way it can end is one line (utils/failures.py)
