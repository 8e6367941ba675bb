#!/usr/bin/env python
"""What the PyTorch lessons' data idiom costs per training step, against the alternative it replaced.

    python tools/data_cost.py [--rounds 7] [--batch-size 32] [--world 2]

In one process, one thread (as each CPU rank of the benchmark), round after round and taking turns:
  idiom    the lessons' loader: DataLoader(TensorDataset(x, y), sampler=DistributedSampler(...), batch_size),
           set_epoch, one pass over this rank's shard (num_workers=0: the tensors are already in memory)
  index    the course's former batching: a seeded permutation, this rank's every world-th index, x[idx], y[idx]
  step     one training step of the lessons' CNN on one batch (forward, nll_loss, backward, SGD step)
and prints the median milliseconds per batch of each and the idiom's extra cost as a share of a step.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root, after site-packages
from course.torch_utils import Net, to_tensors
from utils import data


def per_batch(fn, batches):
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000 / batches


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--world", type=int, default=2, help="the shard of rank 0 of this many ranks")
    parser.add_argument("--steps", type=int, default=20, help="training steps timed per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y, _, _ = to_tensors(data.load_shipped(), "cpu")
    train_set = TensorDataset(x, y)
    loader = DataLoader(train_set, batch_size=args.batch_size, drop_last=True,
                        sampler=DistributedSampler(train_set, num_replicas=args.world, rank=0, seed=42))
    batches = len(loader)

    def idiom(epoch=[0]):
        epoch[0] += 1
        loader.sampler.set_epoch(epoch[0])
        for xb, yb in loader:
            pass

    def index(epoch=[0]):
        epoch[0] += 1
        order = np.random.default_rng(42 + epoch[0]).permutation(len(y))[0::args.world]
        for i in range(batches):
            idx = torch.from_numpy(np.ascontiguousarray(order[i * args.batch_size:(i + 1) * args.batch_size]))
            x[idx], y[idx]  # the gather itself is what this variant costs

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    xb, yb = x[:args.batch_size], y[:args.batch_size]

    def steps():
        for _ in range(args.steps):
            optimizer.zero_grad()
            F.nll_loss(model(xb), yb).backward()
            optimizer.step()

    steps(), idiom(), index()  # warm-up
    timings = {"idiom": [], "index": [], "step": []}
    for r in range(args.rounds):
        order = [("idiom", idiom, batches), ("index", index, batches), ("step", steps, args.steps)]
        for name, fn, n in order if r % 2 == 0 else order[::-1]:
            timings[name].append(per_batch(fn, n))
    med = {k: statistics.median(v) for k, v in timings.items()}
    extra = [(a - b) / s for a, b, s in zip(timings["idiom"], timings["index"], timings["step"])]
    print(f"batch {args.batch_size}, rank 0 of {args.world}, {batches} batches per epoch, {args.rounds} rounds, "
          f"one thread; median ms per batch:")
    print(f"  DataLoader + DistributedSampler  {med['idiom']:.3f}")
    print(f"  index batching (former)          {med['index']:.3f}")
    print(f"  one training step                {med['step']:.1f}")
    print(f"  the idiom's extra cost: {100 * statistics.median(extra):.2f}% of a step "
          f"(rounds: {100 * min(extra):.2f}% to {100 * max(extra):.2f}%)")


if __name__ == "__main__":
    main()
