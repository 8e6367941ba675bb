"""Course plumbing: a checkpoint that proves it is whole. Each one the lessons write carries the
SHA-256 of its files in a SHA256SUMS file beside them (sha256sum's format: `sha256sum -c
SHA256SUMS` in the folder checks it by hand), and a resume checks them before anything is loaded:
bytes damaged in place, which leave a file's structure readable, are one line and exit 2, not a
run that trains on from garbage and overwrites the checkpoint. A checkpoint without the file (a
copied lesson's, an older one, a universal checkpoint) is loaded as before.

Asked first by utils/log.py's atomic_write (plumbing.py registers it; a lesson's copy runs without
it), in an order that a kill at any moment leaves a checkpoint that verifies:
- checkpoint.pt (DDP, Horovod PyTorch), replaced in place: the new digest is added to the old one
  first, the file renamed into place, then the old digest dropped;
- DeepSpeed's and FSDP2's folders, one per save: their `latest` names the newest. Before `latest`
  points at a folder, its files (every rank's, written by then) are listed in its SHA256SUMS;
- TensorFlow's CheckpointManager (course/wrap.py): after each save, the files of the checkpoints it
  keeps (its own CRCs say "Checksum does not match" from inside RestoreV2, after the ranks began).
"""
import contextlib
import hashlib
import io
import os

from course.errors import UserError
from utils.log import replace_file

SUMS = "SHA256SUMS"
SEALED = ("checkpoint.pt", "latest")  # the files whose atomic write commits a checkpoint


def digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_sums(folder):
    """{file name: the digests accepted for it}, or None without a SHA256SUMS."""
    try:
        with open(os.path.join(folder, SUMS)) as f:
            lines = [line.rstrip("\n").split("  ", 1) for line in f if line.strip()]
    except FileNotFoundError:
        return None
    accepted = {}
    for value, name in lines:
        accepted.setdefault(name, set()).add(value)
    return accepted


def files_of(folder):
    """Every file under `folder` (relative names), but the sums and half-written temporary files."""
    return sorted(os.path.relpath(os.path.join(top, name), folder)
                  for top, _, names in os.walk(folder) for name in names
                  if name != SUMS and not name.startswith(".tmp-"))


def write_sums(folder, entries):
    replace_file(os.path.join(folder, SUMS),
                 lambda f: f.writelines(f"{value}  {name}\n" for value, name in entries))


def seal(path, write_fn, mode):
    """Asked first by log.atomic_write (plumbing.py registers it with log.seal_with): writes the
    files that commit a checkpoint itself, with their digests; True if it did."""
    name = os.path.basename(path)
    if name not in SEALED:
        return False
    buffer = io.BytesIO() if "b" in mode else io.StringIO()
    write_fn(buffer)  # the content first, to know its digest before it is in place
    content = buffer.getvalue()
    folder = os.path.dirname(os.path.abspath(path))
    if name == "latest":  # the folder it will name is complete: list its files first
        saved = os.path.join(folder, content.strip())
        write_sums(saved, [(digest(os.path.join(saved, f)), f) for f in files_of(saved)])
        replace_file(path, lambda f: f.write(content), mode)
        return True
    data = content if isinstance(content, bytes) else content.encode()
    new = hashlib.sha256(data).hexdigest()
    old = sorted((read_sums(folder) or {}).get(name, set()) - {new})
    write_sums(folder, [(new, name)] + [(value, name) for value in old])  # both, meanwhile
    replace_file(path, lambda f: f.write(content), mode)
    write_sums(folder, [(new, name)])
    return True


def verify(folder):
    """Before a resume loads anything: every file SHA256SUMS lists (in `folder`, or in the folder
    its `latest` names) has the bytes it was written with. Else one line naming the file."""
    latest = os.path.join(folder, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            folder = os.path.join(folder, f.read().strip())
    accepted, sums = read_sums(folder), os.path.join(folder, SUMS)
    if accepted and (newest := _tensorflow_newest(folder)):  # that checkpoint's files only
        accepted = {name: v for name, v in accepted.items() if name.startswith(f"{newest}.")}
    for name, values in sorted((accepted or {}).items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise UserError(f"checkpoint file {path} is missing ({sums} lists it): resume from a "
                            "complete copy, or start again without --resume")
        if digest(path) not in values:
            raise UserError(f"checkpoint file {path} is damaged: its bytes are not the ones "
                            f"written (SHA-256 in {sums}): resume from an intact copy, or start "
                            "again without --resume")


def seal_tensorflow(folder):
    """After tf.train.CheckpointManager.save: the SHA-256 of the files of the checkpoints it keeps
    (ckpt-N.index, ckpt-N.data-...). Its `checkpoint` file, rewritten at each save, names the newest:
    a kill before the sums are written leaves the newest unlisted, loaded as an unsealed one."""
    write_sums(folder, [(digest(os.path.join(folder, f)), f) for f in files_of(folder)
                        if f.startswith("ckpt-")])


def _tensorflow_newest(folder):
    """The newest checkpoint's prefix (`ckpt-2`) a TensorFlow `checkpoint` file names, or None."""
    with contextlib.suppress(OSError):
        with open(os.path.join(folder, "checkpoint")) as f:
            for line in f:
                if line.startswith("model_checkpoint_path:"):
                    return os.path.basename(line.split(":", 1)[1].strip().strip('"'))
    return None
