#!/usr/bin/env python
"""The yardstick of the examples' *overhead*: their model, optimizer and data in a plain training loop, one
process, no distributed framework (no DDP wrapper, no Horovod, no DeepSpeed engine).

    PHASES_OUT=PREFIX python tools/bare_loop.py --epochs 3 --max-steps 40 [--optimizer adam]
    python tools/bare_loop.py --framework tf --epochs 2 --max-steps 40 --log-dir DIR

PyTorch: the CNN of course/torch_utils.py (Net) on the training digits, batches from a DataLoader over the
preloaded tensors with a DistributedSampler of one replica (the examples' data path), SGD with momentum or Adam
(`--adam-config`: a DeepSpeed config whose optimizer params, betas/eps/weight_decay, it copies). Each step is
timed by tools/phases.py's timers, the same that time an example's step, and the records go to
$PHASES_OUT-rank0.json as phases.py writes them; with $PHASES_TURNS it takes turns with the example step by step.
TensorFlow: the Keras CNN of horovod/tensorflow/main.py (its Net) with SGD in a tf.function step on batches sliced
from the preloaded arrays; samples/s per epoch go to DIR/metrics.jsonl, as the examples write them.
`python tools/bench.py` starts it (bench_overhead.py); it needs no launcher.
"""
import argparse
import json
import os
import sys
import time
from itertools import islice
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after site-packages: our horovod/ and deepspeed/ folders never shadow the libraries


def train_arrays(data_dir=None):
    """The training digits as normalized float32 [N, 28, 28] and int64 labels (what every example trains on)."""
    from utils.data import load_mnist, normalized
    mnist = load_mnist(data_dir)
    return normalized(mnist.x_train), mnist.y_train


def adam_params(config_file):
    """Adam's betas, eps and weight decay from a DeepSpeed config's optimizer params (the rest is DeepSpeed's)."""
    params = json.loads(Path(config_file).read_text()).get("optimizer", {}).get("params", {})
    return {k: tuple(v) if k == "betas" else v for k, v in params.items() if k in ("betas", "eps", "weight_decay")}


def torch_loop(args):
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from course.torch_utils import Net
    from tools import phases
    out = os.environ.get("PHASES_OUT")
    if not out:
        sys.exit("usage: PHASES_OUT=PREFIX python tools/bare_loop.py [flags]")
    torch.set_num_threads(args.num_threads)
    x, y = train_arrays(args.data_dir)
    dataset = TensorDataset(torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y))
    loader = DataLoader(dataset, batch_size=args.batch_size, drop_last=True,
                        sampler=DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=args.seed))
    torch.manual_seed(args.seed)
    model = Net()
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, **adam_params(args.adam_config))
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    timer = phases.StepTimer(turns=phases.Turns.from_env())
    phases.patch(timer, "bare")  # the example's timers: Net.forward, Tensor.backward, the optimizer's step
    for epoch in range(1, args.epochs + 1):
        loader.sampler.set_epoch(epoch)
        model.train()
        timer.start_epoch(epoch)
        for xb, yb in islice(loader, args.max_steps):
            optimizer.zero_grad()
            F.nll_loss(model(xb), yb).backward()
            optimizer.step()
    Path(f"{out}-rank0.json").write_text(json.dumps({"rank": 0, "framework": "bare", "records": timer.records}))


def tf_loop(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.num_threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.set_visible_devices([], "GPU")
    x, y = train_arrays(args.data_dir)
    x = x[..., np.newaxis]
    keras.utils.set_random_seed(args.seed)
    L = keras.layers  # the lessons' Keras CNN (horovod/tensorflow/main.py's Net)
    model = keras.Sequential([keras.Input((28, 28, 1)), L.Conv2D(32, 3, activation="relu"),
                              L.Conv2D(64, 3, activation="relu"), L.MaxPooling2D(2), L.Dropout(0.25), L.Flatten(),
                              L.Dense(128, activation="relu"), L.Dropout(0.5), L.Dense(10)])
    optimizer = keras.optimizers.SGD(learning_rate=args.lr, momentum=args.momentum)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    rng, history = np.random.default_rng(args.seed), []
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(y))
        steps = min(args.max_steps or len(y), len(y) // args.batch_size)
        start = time.perf_counter()
        for i in range(steps):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            step(tf.constant(x[idx]), tf.constant(y[idx]))
        seconds = time.perf_counter() - start
        history.append(dict(epoch=epoch, train_time_s=seconds, samples_per_s=steps * args.batch_size / seconds,
                            world_size=1, framework="bare-tensorflow"))
        (log_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in history))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--framework", choices=["torch", "tf"], default="torch")
    p.add_argument("--epochs", type=int, default=3, help="the first is warm-up for whoever reads the timings")
    p.add_argument("--max-steps", type=int, default=40, help="steps per epoch")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd", help="(PyTorch) SGD with momentum or Adam")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--adam-config", default=str(ROOT / "deepspeed" / "ds_config.json"),
                   help="(--optimizer adam) a DeepSpeed config: Adam's betas, eps, weight_decay")
    p.add_argument("--data-dir", default=None, help="MNIST files (default: the shipped digits)")
    p.add_argument("--log-dir", help="(TensorFlow) where metrics.jsonl goes")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.framework == "tf" and not args.log_dir:
        p.error("--framework tf needs --log-dir")
    (tf_loop if args.framework == "tf" else torch_loop)(args)


if __name__ == "__main__":
    main()
