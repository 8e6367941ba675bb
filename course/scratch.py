"""Course plumbing: a temporary folder of this process's own (tempfile.tempdir), removed at every
ending.

TensorFlow's autograph writes a source file per traced function to the temporary folder and removes
it only in an atexit hook, which an ending through os._exit skips (a stop, a lost peer:
course/failures.py): one stopped 2-rank run of horovod/tensorflow/main.py left 38 files in /tmp. A
folder whose process was killed (SIGKILL runs no hook) is removed when the next one starts.
"""
import atexit
import getpass
import os
import shutil
import socket
import tempfile

TMP_PREFIX = f"scaling-dl-tmp-{socket.gethostname()}-"


def private_tmp():
    if os.path.basename(tempfile.tempdir or "").startswith(TMP_PREFIX):
        return  # (set already)
    base = tempfile.gettempdir()
    # torch.compile's cache of built kernels stays where torch keeps it without us, shared by runs:
    # in this process's folder every `--compile` run would build it again (about 45 s on 2 cores)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(base, f"torchinductor_{_user()}"))
    for name in os.listdir(base):
        pid = name[len(TMP_PREFIX):]
        if name.startswith(TMP_PREFIX) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    tempfile.tempdir = os.path.join(base, f"{TMP_PREFIX}{os.getpid()}")
    os.makedirs(tempfile.tempdir, exist_ok=True)
    atexit.register(remove_private_tmp)


def remove_private_tmp():
    if os.path.basename(tempfile.tempdir or "").startswith(TMP_PREFIX):
        shutil.rmtree(tempfile.tempdir, ignore_errors=True)


def _user():
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # (a container's uid with no name)
        return str(os.getuid())


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # (another user's)
    return True
