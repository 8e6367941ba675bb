"""TensorFlow pieces shared by the Horovod-TensorFlow examples (model, tf.data shards, threads,
checksum)."""
import hashlib

import numpy as np
import tensorflow as tf  # (utils/quiet.py, imported with utils, keeps its start-up banner out)

from utils.data import normalized
from utils.errors import UserError


def configure_tf(device, local_rank, num_threads):
    """Threads and GPU visibility: must run before TensorFlow creates its runtime (before any op).
    """
    tf.config.threading.set_intra_op_parallelism_threads(num_threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    gpus = tf.config.list_physical_devices("GPU")
    # Intel GPUs: the course's TensorFlow lessons have no path there (Horovod TF is not on Aurora).
    if device == "xpu":
        raise UserError("--device xpu: the TensorFlow lessons run on CPUs and NVIDIA GPUs; "
                        "on Intel GPUs (Aurora) use DDP/main.py")
    if device == "cuda" and not gpus:
        raise UserError("--device cuda: TensorFlow sees no GPU "
                        "(tf.config.list_physical_devices('GPU') is empty); "
                        "use --device cpu or auto")
    if device == "cpu" or not gpus:
        tf.config.set_visible_devices([], "GPU")
        return "cpu"
    gpu = gpus[local_rank % len(gpus)]
    tf.config.set_visible_devices(gpu, "GPU")  # one GPU per process, chosen by local rank
    tf.config.experimental.set_memory_growth(gpu, True)
    return f"gpu:{local_rank % len(gpus)}"


def build_model(keras, dropout):
    """The same CNN as the PyTorch examples (pytorch/examples' MNIST net), in Keras; outputs logits.
    """
    layers = keras.layers
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        layers.Conv2D(32, 3, activation="relu"),
        layers.Conv2D(64, 3, activation="relu"),
        layers.MaxPooling2D(2),
        layers.Dropout(dropout),
        layers.Flatten(),
        layers.Dense(128, activation="relu"),
        layers.Dropout(2 * dropout),
        layers.Dense(10),
    ])


def images(array):
    return normalized(array)[..., np.newaxis]  # [N, 28, 28, 1] float32


def one_thread(dataset):
    """tf.data runs pipelines on a thread pool as large as the machine's core count, and its
    autotuner adds threads; with every core already running a rank, they compete with the training
    step. These pipelines only slice arrays already in memory: one private thread is plenty
    (tools/PERFORMANCE.md)."""
    options = tf.data.Options()
    options.threading.private_threadpool_size = 1
    options.autotune.enabled = False
    return dataset.with_options(options)


def checksum(variables):
    """sha256 of every variable's bytes, in order: equal on two ranks only if their weights are
    identical."""
    h = hashlib.sha256()
    for v in variables:
        h.update(np.asarray(v.numpy(), dtype=np.float32).tobytes())
    return h.hexdigest()[:16]


def restore_latest(checkpoint, manager):
    """Restore `manager`'s newest checkpoint into `checkpoint`; a missing, truncated or corrupted
    checkpoint, or one of another model, is a UserError (one line), not a traceback."""
    if manager.latest_checkpoint is None:
        raise UserError(f"--resume: no checkpoint in {manager.directory}")
    try:
        checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
    except Exception as exc:
        detail = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise UserError(f"checkpoint {manager.latest_checkpoint} does not load (truncated, "
                        f"corrupted or of another model?): {detail}") from exc
    return manager.latest_checkpoint
