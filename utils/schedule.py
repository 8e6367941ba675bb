"""The learning-rate rule every example uses: linear scaling with the world size, and warmup.

Goyal et al. 2017 ("Accurate, Large Minibatch SGD"): when the global batch grows k times, multiply
the learning rate by k; start from the single-worker rate and ramp linearly to the scaled one over
the first few epochs, because the scaled rate is too large while the weights are still random.
"""


def scaled_lr(base_lr, world_size, enabled=True):
    return base_lr * world_size if enabled else base_lr


def lr_at(epoch_progress, base_lr, target_lr, warmup_epochs):
    """LR at `epoch_progress` (0-based, fractional: 1.5 = halfway through the second epoch)."""
    if warmup_epochs and epoch_progress < warmup_epochs:
        return base_lr + (target_lr - base_lr) * epoch_progress / warmup_epochs
    return target_lr
