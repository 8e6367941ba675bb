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
import hashlib
import os
import sys
import time
from pathlib import Path

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # must precede the first TensorFlow import
sys.path.append(str(Path(__file__).resolve().parents[2]))  # the repo root *after* site-packages
try:  # course plumbing, no step of the recipe (course/plumbing.py): the libraries' noise filtered,
    from course import plumbing  # flags checked, every ending one line. A copy runs without it.
except ImportError:
    plumbing = None

import numpy as np
import tensorflow as tf
import tf_keras

from utils import data, log  # the course's helpers: MNIST, and rank 0's lines and run files
from utils.parse_args import get_parser

# Horovod 0.28's Keras module does `from keras import backend`, which is Keras 3 here and lacks what
# its callbacks use. In this process every Keras is Keras 2 (tf.keras is tf-keras), so let `keras`
# mean it too.
sys.modules["keras"] = tf_keras
import horovod.tensorflow as hvd_tf  # its allreduce takes op=Sum/Max, for our metrics
import horovod.tensorflow.keras as hvd

CPU_KNOBS = {"HOROVOD_CYCLE_TIME": "5"}  # ms between Horovod's rounds (default 1): CPU ranks
ONE_THREAD = tf.data.Options()  # tf.data's own thread pool would compete with the ranks for cores
ONE_THREAD.threading.private_threadpool_size = 1
ONE_THREAD.autotune.enabled = False


def Net(dropout):  # pytorch/examples' MNIST CNN in Keras; outputs logits
    L = tf.keras.layers
    return tf.keras.Sequential([tf.keras.Input((28, 28, 1)), L.Conv2D(32, 3, activation="relu"),
                                L.Conv2D(64, 3, activation="relu"), L.MaxPooling2D(2),
                                L.Dropout(dropout), L.Flatten(), L.Dense(128, activation="relu"),
                                L.Dropout(2 * dropout), L.Dense(10)])


class EpochLog(tf.keras.callbacks.Callback):
    """Rank 0's progress lines; after each epoch: evaluate this rank's test shard, sum over ranks,
    write metrics.jsonl on rank 0."""

    def __init__(self, run, x_test, y_test, args):
        super().__init__()
        self.run, self.args = run, args
        shard = slice(hvd.rank(), None, hvd.size())  # [3] this rank's share of the test set
        self.x_test, self.y_test = x_test[shard], y_test[shard]

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()
        self.progress = log.Progress(hvd.rank() == 0, self.params["steps"], epoch + 1,
                                     self.args.log_interval)

    def on_train_batch_end(self, batch, logs=None):
        self.progress.update(batch + 1, logs["loss"])  # this rank's mean loss of the epoch so far

    def on_epoch_end(self, epoch, logs=None):
        train_time = time.perf_counter() - self.start
        logits = self.model.predict(self.x_test, batch_size=self.args.test_batch_size, verbose=0)
        labels = self.y_test
        losses = tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        seen = self.params["steps"] * self.args.batch_size
        # logs["loss"] and logs["accuracy"] are already averaged over ranks by MetricAverageCallback
        sums = [logs["loss"] * seen, logs["accuracy"] * seen, seen, float(losses.numpy().sum()),
                float((logits.argmax(1) == labels).sum()), len(labels)]
        sums = tf.constant(sums, tf.float64)
        sums = hvd_tf.allreduce(sums, op=hvd_tf.Sum, name="metrics").numpy()  # [7]
        sums[:3] /= hvd.size()  # the train part was already a global average
        train_time = tf.constant(train_time, tf.float64)
        train_time = float(hvd_tf.allreduce(train_time, op=hvd_tf.Max, name="max"))
        lr = float(tf.keras.backend.get_value(self.model.optimizer.learning_rate))
        self.run.epoch_end(epoch + 1, sums.tolist(), lr, time.perf_counter() - self.start,
                           train_time)


def main(args):
    if args.grad_accum != 1 or args.resume or args.device == "xpu":
        sys.exit("error: --grad-accum, --resume: in horovod/tensorflow/main.py, not in this Keras-"
                 "API lesson; --device xpu: on Intel GPUs (Aurora) use DDP/main.py")
    gpus = tf.config.list_physical_devices("GPU") if args.device != "cpu" else []
    if args.device == "cuda" and not gpus:
        sys.exit("error: --device cuda: TensorFlow sees no GPU; use --device cpu or auto")
    for name, value in ({} if gpus else CPU_KNOBS).items():  # read by hvd.init(): set them first
        os.environ.setdefault(name, value)
    os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(args.dist_timeout))  # gloo's ops
    hvd.init()  # [1] start Horovod
    e, rank, size = os.environ, hvd.rank(), hvd.size()  # the launcher's name, for the logs:
    launcher = ("horovodrun" if "HOROVOD_RANK" in e else "python" if size == 1 else "srun" if
                "SLURM_STEP_ID" in e and "MPI_LOCALRANKID" not in e else "mpiexec")
    controller = "horovod-" + ("mpi" if hvd.mpi_enabled() else "gloo")
    # [2] one GPU per process (number = local rank), threads sized to the rank's share of the cores
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.num_threads or (cores if cores < os.cpu_count() else
                                   cores // hvd.local_size() or 1)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    mine = [gpus[hvd.local_rank() % len(gpus)]] if gpus else []  # this rank's GPU; CPUs: none
    tf.config.set_visible_devices(mine, "GPU")
    for gpu in mine:
        tf.config.experimental.set_memory_growth(gpu, True)
    device = f"gpu:{hvd.local_rank() % len(gpus)}" if gpus else "cpu"
    log.configure(rank, hvd.local_rank(), args.log_all_ranks)
    log_dir = args.log_dir or hvd_tf.broadcast_object(log.default_log_dir("horovod-keras"))
    run = log.RunLog(log_dir, rank == 0)
    mnist = data.load_mnist(args.data_dir, args.download, rank == 0,
                            barrier=lambda: hvd_tf.broadcast_object(None, root_rank=0))
    knobs = {name: os.environ.get(name, "Horovod's default") for name in CPU_KNOBS}
    log.info(f"horovod-keras: {size} rank(s) via {launcher}, device {device}, {controller} "
             f"controller, {threads} thread(s) per rank, HOROVOD_CYCLE_TIME "
             f"{knobs['HOROVOD_CYCLE_TIME']}\n{mnist.describe()}")
    x_train, y_train = data.normalized(mnist.x_train)[..., None], mnist.y_train
    x_test, y_test = data.normalized(mnist.x_test)[..., None], mnist.y_test
    # [3] model.fit runs every epoch from one dataset: the same seeded shuffle on every rank (a new
    #     order each epoch), then this rank's shard by *global* rank; every rank runs `steps` steps
    #     an epoch.
    steps = data.batches_per_rank(len(y_train), size, args.batch_size, args.max_steps)
    dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
               .shuffle(len(y_train), seed=args.seed, reshuffle_each_iteration=True)
               .shard(size, rank).batch(args.batch_size, drop_remainder=True)
               .take(steps).repeat().with_options(ONE_THREAD))
    tf.keras.utils.set_random_seed(args.seed)
    model = Net(args.dropout)
    lr = args.lr if args.no_lr_scaling else args.lr * size  # [4] scale the LR
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
    callbacks.append(EpochLog(run, x_test, y_test, args))
    run.write_config(args, dict(rank=rank, local_rank=hvd.local_rank(), world_size=size,
                                local_world_size=hvd.local_size(), launcher=launcher,
                                device=device, backend=controller, num_threads=threads,
                                log_dir=log_dir, scaled_lr=lr, horovod_knobs=knobs),
                     "horovod-keras")
    # [8] none: this lesson writes no checkpoint (horovod/tensorflow/main.py does)
    model.fit(dataset, steps_per_epoch=steps, epochs=args.epochs, callbacks=callbacks, verbose=0)
    weights = np.concatenate([np.asarray(v.numpy(), np.float32).ravel() for v in model.variables])
    checksums = hvd_tf.allgather_object(hashlib.sha256(weights.tobytes()).hexdigest()[:16])
    if args.save_model and rank == 0:  # all checksums equal, or something broke
        model.save_weights(str(Path(log_dir) / "model.weights.h5"))
    run.summary({"param_checksums": checksums, "device": device})
    hvd.shutdown()  # Horovod's background thread joined: the interpreter's teardown finds it gone


if __name__ == "__main__":
    parser = get_parser(__doc__, backend=False)
    if plumbing:
        plumbing.run_main(main, parser)
    else:
        main(parser.parse_args())
