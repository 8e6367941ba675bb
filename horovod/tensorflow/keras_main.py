#!/usr/bin/env python
"""MNIST with Horovod's Keras API: hvd.DistributedOptimizer + model.fit + Horovod's callbacks.

Horovod 0.28's Keras integration needs Keras 2, which TensorFlow 2.21 ships separately as
`tf-keras`; TF_USE_LEGACY_KERAS=1 (set below, before TensorFlow is imported) makes tf.keras mean
tf-keras.
    python horovod/tensorflow/keras_main.py
    horovodrun -np 2 --gloo python horovod/tensorflow/keras_main.py
    mpiexec -n 2 python horovod/tensorflow/keras_main.py
The numbered comments [1]-[8] are the course's recipe (README.md, "The recipe");
horovod/tensorflow/README.md explains them.
"""
import os
import sys
import time
from pathlib import Path

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # must precede the first TensorFlow import
sys.path.append(str(Path(__file__).resolve().parents[2]))  # the repo root *after* site-packages
import utils

utils.course_output()  # course plumbing: a missing framework is one line; noise filtered

import tensorflow as tf
import tf_keras

from utils import checks, data, failures, log
from utils import dist as course  # which variables each launcher sets; Horovod's CPU knobs
from utils.board import Board
from utils.errors import UserError
from utils.parse_args import get_parser
from utils.schedule import scaled_lr
from utils.tf_utils import build_model, checksum, configure_tf, images, one_thread

# Horovod 0.28's Keras module does `from keras import backend`, which is Keras 3 here and lacks what
# its callbacks use. In this process every Keras is Keras 2 (tf.keras is tf-keras), so let `keras`
# mean it too.
sys.modules["keras"] = tf_keras
import horovod.tensorflow as hvd_tf  # its allreduce takes op=Sum/Max, for our metrics
import horovod.tensorflow.keras as hvd

FRAMEWORK = "horovod-keras"


class EpochLog(tf.keras.callbacks.Callback):
    """After each epoch: evaluate this rank's test shard, sum over ranks, write metrics.jsonl on
    rank 0."""

    def __init__(self, run, env, x_test, y_test, test_batch_size, train_batch_size, log_interval):
        super().__init__()
        self.run, self.env, self.log_interval = run, env, log_interval
        shard = slice(env.rank, None, env.world_size)  # [3] this rank's share of the test set
        self.x_test, self.y_test = x_test[shard], y_test[shard]
        self.test_batch_size, self.train_batch_size = test_batch_size, train_batch_size

    def on_epoch_begin(self, epoch, logs=None):
        self.start, self.epoch = time.perf_counter(), epoch + 1
        # silent: it only notes where a Ctrl-C or a lost peer stopped it (Keras prints the steps)
        self.progress = log.Progress(False, self.params["steps"], epoch + 1, self.log_interval)

    def on_train_batch_end(self, batch, logs=None):
        step, total = batch + 1, self.params["steps"]
        self.progress.update(step, None)
        if self.env.is_main and (step % self.log_interval == 0 or step == total):
            # TensorBoard's step/train_loss; in Keras: this rank's mean loss of the epoch so far
            Board.step((self.epoch - 1) * total + step, logs["loss"])

    def on_epoch_end(self, epoch, logs=None):
        train_time = time.perf_counter() - self.start
        logits = self.model.predict(self.x_test, batch_size=self.test_batch_size, verbose=0)
        labels = self.y_test
        losses = tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        loss = float(losses.numpy().sum())
        correct = float((logits.argmax(1) == labels).sum())
        seen = self.params["steps"] * self.train_batch_size
        # logs["loss"] and logs["accuracy"] are already averaged over ranks by MetricAverageCallback
        sums = [logs["loss"] * seen, logs["accuracy"] * seen, seen, loss, correct, len(labels)]
        sums = tf.constant(sums, tf.float64)
        sums = hvd_tf.allreduce(sums, op=hvd_tf.Sum, name="metrics").numpy()  # [7]
        sums[:3] /= self.env.world_size  # the train part was already a global average
        train_time = tf.constant(train_time, tf.float64)
        train_time = float(hvd_tf.allreduce(train_time, op=hvd_tf.Max, name="max"))
        lr = float(tf.keras.backend.get_value(self.model.optimizer.learning_rate))
        self.run.epoch_end(epoch + 1, sums.tolist(), lr, time.perf_counter() - self.start,
                           train_time)


def main():
    args = checks.parse(get_parser(__doc__, backend=False))
    for flag, given in (("--grad-accum", args.grad_accum != 1), ("--resume", args.resume)):
        if given:
            raise UserError(f"{flag} is implemented in horovod/tensorflow/main.py, "
                                "not in this Keras-API example")
    wall_start = time.perf_counter()

    # --- set up distributed ----------------------------------------------------------------------
    on_cpu = args.device == "cpu" or not tf.config.list_physical_devices("GPU")
    knobs = course.horovod_knobs(on_cpu=on_cpu, dist_timeout=args.dist_timeout)
    hvd.init()  # [1] start Horovod
    num_threads = course.threads_per_rank(args.num_threads, hvd.local_size())
    device = configure_tf(args.device, hvd.local_rank(), num_threads)  # [2] one GPU per process
    controller = "horovod-" + ("mpi" if hvd.mpi_enabled() else "gloo")
    env = course.DistEnv(hvd.rank(), hvd.local_rank(), hvd.size(), hvd.local_size(),
                         course.discover().launcher, device=device, backend=controller,
                         num_threads=num_threads)
    log.configure(env.rank, env.local_rank, args.log_all_ranks)
    log_dir = args.log_dir or hvd_tf.broadcast_object(log.default_log_dir("horovod-keras"),
                                                      root_rank=0)
    run = log.RunLog(log_dir, env.is_main)
    log.info(f"{FRAMEWORK}: {env.world_size} rank(s) via {env.launcher}, device {env.device}, "
             f"{env.backend} controller, {env.num_threads} thread(s) per rank, "
             f"HOROVOD_CYCLE_TIME {knobs['HOROVOD_CYCLE_TIME']}")

    # --- data ------------------------------------------------------------------------------------
    mnist = data.load_mnist(args.data_dir, args.download, env.is_main,
                            barrier=lambda: hvd_tf.broadcast_object(None, root_rank=0))
    log.info(mnist.describe())
    x_train, y_train = images(mnist.x_train), mnist.y_train
    x_test, y_test = images(mnist.x_test), mnist.y_test
    # [3] model.fit runs every epoch from one dataset: the same seeded shuffle on every rank (a new
    #     order each epoch), then this rank's shard by *global* rank; every rank runs `steps` steps
    #     an epoch.
    steps = len(y_train) // hvd.size() // args.batch_size
    if steps == 0:
        raise data.DataError(f"{len(y_train)} training samples are too few for {hvd.size()} ranks "
                             f"x batch {args.batch_size}: lower --batch-size or the ranks")
    steps = min(steps, args.max_steps or steps)
    dataset = one_thread(tf.data.Dataset.from_tensor_slices((x_train, y_train))
                         .shuffle(len(y_train), seed=args.seed, reshuffle_each_iteration=True)
                         .shard(hvd.size(), hvd.rank()).batch(args.batch_size, drop_remainder=True)
                         .take(steps).repeat())

    # --- model and optimizer ---------------------------------------------------------------------
    tf.keras.utils.set_random_seed(args.seed)
    model = build_model(tf.keras, args.dropout)
    lr = scaled_lr(args.lr, hvd.size(), not args.no_lr_scaling)  # [4] scale the LR
    # [6] wrap the optimizer: gradients are averaged across ranks before each update
    sgd = tf.keras.optimizers.SGD(learning_rate=lr, momentum=args.momentum)
    optimizer = hvd.DistributedOptimizer(sgd)
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # [5] start from rank 0's weights
        hvd.callbacks.MetricAverageCallback(),  # [7] average the train metrics over ranks
    ]
    if args.lr_warmup_epochs:  # Goyal et al.: ramp from lr/size to lr over the first epochs
        callbacks.append(hvd.callbacks.LearningRateWarmupCallback(
            initial_lr=lr, warmup_epochs=args.lr_warmup_epochs, steps_per_epoch=steps,
            # tf-keras keeps momentum as a float: nothing to correct
            momentum_correction=False, verbose=0))
    callbacks.append(EpochLog(run, env, x_test, y_test, args.test_batch_size, args.batch_size,
                              args.log_interval))
    run.write_config(args, env.as_dict(), FRAMEWORK, {"log_dir": log_dir, "scaled_lr": lr,
                                                 "horovod_knobs": knobs})

    # --- train / evaluate ------------------------------------------------------------------------
    model.fit(dataset, steps_per_epoch=steps, epochs=args.epochs, callbacks=callbacks,
              verbose=2 if env.is_main else 0)

    # --- summary ---------------------------------------------------------------------------------
    checksums = hvd_tf.allgather_object(checksum(model.variables))
    if args.save_model and env.is_main:
        model.save_weights(str(Path(log_dir) / "model.weights.h5"))
    run.summary({"wall_time_s": time.perf_counter() - wall_start, "param_checksums": checksums,
                 "device": env.device, "world_size": env.world_size, "launcher": env.launcher,
                 "framework": FRAMEWORK})


if __name__ == "__main__":
    failures.run_main(main)  # course plumbing: each way it can end is one line (utils/failures.py)
