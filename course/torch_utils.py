"""PyTorch pieces for the course's tools, diagnose/ and tests (the MNIST CNN as a module, the
digits as tensors, steps per epoch). The lessons do not import it: each holds its own model and
loop in plain code."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from utils.data import DataError, normalized


class Net(nn.Module):
    """The pytorch/examples MNIST CNN (1.2M parameters): two convolutions, max-pool, two dense
    layers."""

    def __init__(self, dropout=0.25):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(2 * dropout)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def to_tensors(mnist, device):
    """Preload the whole set as normalized tensors on the device: no per-sample transforms in the
    hot loop."""
    def images(a):
        return torch.from_numpy(normalized(a)).unsqueeze(1).to(device)
    return (images(mnist.x_train), torch.from_numpy(mnist.y_train).to(device),
            images(mnist.x_test), torch.from_numpy(mnist.y_test).to(device))


def steps_per_epoch(loaders, max_steps=None):
    """Training steps this epoch: full batches of one rank's shard (every rank has as many), capped
    by --max-steps. No full batch at all is an input error, reported in one line."""
    steps = len(loaders[0])
    if steps == 0:
        sampler = loaders[0].sampler
        raise DataError(f"{len(sampler.dataset)} training samples are too few for "
                        f"{sampler.num_replicas} ranks x batch {loaders[0].batch_size} "
                        "(with --grad-accum A, count A ranks for each): "
                        "lower --batch-size or the ranks")
    return min(steps, max_steps) if max_steps else steps
