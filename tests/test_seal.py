"""course/seal.py: a checkpoint carries the SHA-256 of its files, and a kill at any moment of a save leaves one that
verifies (the old checkpoint or the new one, never a mismatch); damage in place does not verify. In one process:
a "kill" here is an exception raised instead of one of the save's atomic writes (a real kill leaves the same
files: the previous ones, and a temporary file at most)."""
import types

import pytest

from course import seal
from course.errors import UserError
from support import ROOT  # noqa: F401  (puts the repository on sys.path)
from utils import log

REPLACE_FILE = log.replace_file  # the real one, whatever a test patches


class Killed(Exception):
    pass


def sealing_log(monkeypatch, kill_at=None):
    """utils/log's atomic_write with seal.seal registered, as plumbing.py registers it; the kill_at-th
    write of a whole file raises instead of writing it."""
    calls = []

    def killable(path, write_fn, mode="w"):
        calls.append(path)
        if len(calls) == kill_at:
            raise Killed(path)
        return REPLACE_FILE(path, write_fn, mode)
    monkeypatch.setattr(seal, "replace_file", killable)  # the sealer's own writes
    monkeypatch.setattr(log, "replace_file", killable)  # atomic_write's, when no sealer writes
    monkeypatch.setattr(log, "_SEALERS", [seal.seal])
    return types.SimpleNamespace(atomic_write=log.atomic_write), calls


def save_torch_style(fake, folder, version):  # DDP's [8]: checkpoint.pt replaced in place
    fake.atomic_write(folder / "checkpoint.pt", lambda f: f.write(f"v{version} ".encode() * 1000), "wb")


def save_folder_style(fake, folder, version):  # DeepSpeed's and FSDP2's: a new folder, then `latest`
    saved = folder / f"epoch{version}"
    saved.mkdir(parents=True)
    for rank in range(2):
        (saved / f"rank{rank}_states.pt").write_bytes(f"rank {rank} v{version}".encode() * 1000)
    (saved / ".metadata").write_text(f"v{version}")
    fake.atomic_write(folder / "latest", lambda f: f.write(f"epoch{version}"))


def version_on_disk(folder, style):
    if style is save_torch_style:
        return int((folder / "checkpoint.pt").read_bytes().split()[0][1:])
    return int((folder / "latest").read_text()[len("epoch"):])


@pytest.mark.parametrize("style", [save_torch_style, save_folder_style], ids=["checkpoint.pt", "latest"])
def test_a_kill_at_any_write_of_a_save_leaves_a_checkpoint_that_verifies(tmp_path, style, monkeypatch):
    fake, calls = sealing_log(monkeypatch)
    for version in (1, 2, 3):
        style(fake, tmp_path / "count", version)
    writes = len(calls)  # every atomic write three saves make: the moments a kill can fall between
    assert writes == (9 if style is save_torch_style else 6), calls
    for kill_at in range(1, writes + 1):
        folder = tmp_path / f"killed-at-{kill_at}"
        fake, _ = sealing_log(monkeypatch, kill_at)
        saved = 0
        try:
            for version in (1, 2, 3):
                style(fake, folder, version)
                saved = version
        except Killed:
            pass
        if not (folder / "checkpoint.pt").exists() and not (folder / "latest").exists():
            assert saved == 0
            continue
        seal.verify(str(folder))  # raises if the files on disk are not the ones their sums list
        named = folder / (folder / "latest").read_text() if style is save_folder_style else folder
        assert seal.read_sums(named) is not None, kill_at  # and it is sealed: verified, not taken on trust
        assert version_on_disk(folder, style) in (saved, saved + 1), (kill_at, saved)


@pytest.mark.parametrize("style", [save_torch_style, save_folder_style], ids=["checkpoint.pt", "latest"])
def test_damage_in_place_or_a_missing_file_does_not_verify_and_names_the_file(tmp_path, style, monkeypatch):
    fake, _ = sealing_log(monkeypatch)
    style(fake, tmp_path / "damaged", 1)
    style(fake, tmp_path / "missing", 1)
    target = "checkpoint.pt" if style is save_torch_style else "epoch1/rank1_states.pt"
    raw = bytearray((tmp_path / "damaged" / target).read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one byte: the length and the structure stay
    (tmp_path / "damaged" / target).write_bytes(bytes(raw))
    with pytest.raises(UserError, match=f"checkpoint file {tmp_path / 'damaged' / target} is damaged"):
        seal.verify(str(tmp_path / "damaged"))
    (tmp_path / "missing" / target).unlink()
    with pytest.raises(UserError, match=f"checkpoint file {tmp_path / 'missing' / target} is missing"):
        seal.verify(str(tmp_path / "missing"))


def test_the_sums_are_sha256sums_format_and_a_checkpoint_without_them_loads(tmp_path, monkeypatch):
    import subprocess
    fake, _ = sealing_log(monkeypatch)
    save_folder_style(fake, tmp_path, 1)
    checked = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=tmp_path / "epoch1", capture_output=True,
                             text=True)
    assert checked.returncode == 0 and checked.stdout.count(": OK") == 3, checked.stdout
    (tmp_path / "epoch1" / "SHA256SUMS").unlink()
    seal.verify(str(tmp_path))  # an older checkpoint, or a copied lesson's: as before


def save_tensorflow_style(folder, version, keep=2):
    """tf.train.CheckpointManager.save's files: ckpt-N.index and ckpt-N.data-*, then its `checkpoint` file naming
    the newest, and the oldest beyond `keep` deleted (course/wrap.py seals after it returns)."""
    folder.mkdir(exist_ok=True)
    (folder / f"ckpt-{version}.index").write_bytes(f"index v{version}".encode() * 100)
    (folder / f"ckpt-{version}.data-00000-of-00001").write_bytes(f"weights v{version}".encode() * 1000)
    (folder / "checkpoint").write_text(f'model_checkpoint_path: "ckpt-{version}"\n'
                                       f'all_model_checkpoint_paths: "ckpt-{version}"\n')
    for old in folder.glob(f"ckpt-{version - keep}.*"):
        old.unlink()


def test_a_tensorflow_checkpoint_is_sealed_after_each_save_and_damage_names_its_file(tmp_path, monkeypatch):
    """Its newest checkpoint's files are checked; a kill between TensorFlow's save and the sums leaves the newest
    unlisted (loaded as an unsealed one) and the deleted oldest listed but not asked for."""
    sealing_log(monkeypatch)
    for version in (1, 2):
        save_tensorflow_style(tmp_path, version)
        seal.seal_tensorflow(str(tmp_path))
    seal.verify(str(tmp_path))
    data = tmp_path / "ckpt-2.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(UserError, match=f"checkpoint file {data} is damaged"):
        seal.verify(str(tmp_path))
    save_tensorflow_style(tmp_path, 3)  # ... and killed before its sums: ckpt-1 (listed) is gone
    assert not list(tmp_path.glob("ckpt-1.*")) and "ckpt-1.index" in (tmp_path / "SHA256SUMS").read_text()
    seal.verify(str(tmp_path))
