"""A Horovod throughput job for tflms's tests, modelled on the flow of Horovod's synthetic benchmark.

It does what a user of Horovod's ``examples/tensorflow2/tensorflow2_synthetic_benchmark.py`` does,
with the changes of docs/horovod.md ("Horovod's own example"), and takes the same flags. It was
written for tflms; no code is copied from Horovod. Each rank:

1. starts Horovod with ``tflms.horovod.init(split_cpu=True)`` (without a GPU, ``/device:CPU:1``
   plays the rank's GPU) and seeds everything with its rank number, so that the ranks start from
   different weights and draw different data;
2. builds ``keras.applications.<--model>(weights=None)``, one random batch of 224x224 images with
   random labels, and plain SGD (learning rate 0.01 x number of ranks);
3. runs ``benchmark_step`` under ``tflms.function`` (``tf.function`` with ``--no-tflms``): a forward
   pass inside ``tflms.horovod.DistributedGradientTape``, the update and, on the first batch only,
   ``tflms.horovod.broadcast_variables`` of rank 0's model and optimizer variables;
4. runs 1 + ``--num-warmup-batches`` warm-up steps, then ``--num-iters`` timed iterations of
   ``--num-batches-per-iter`` steps each, and prints (rank 0) img/sec per device, per iteration and
   overall: ``Total img/sec on <ranks> CPU(s): <mean> +-<1.96 std>``.

``--save-weights 'out/rank{rank}.npz'`` saves every rank's ``model.variables + optimizer.variables``
(``arr_0``, ``arr_1``, ...) and has rank 0 print the first line of each plan's summary
(``tflms plan for benchmark_step: N tensors swapped (...)``).

tests/integrations/test_horovod_example.py runs it twice with
``horovodrun --gloo -np 2 -H localhost:2`` and ``--model MobileNetV2 --batch-size 2
--num-warmup-batches 1 --num-batches-per-iter 2 --num-iters 1 --no-cuda``, once as it is and once
with ``--no-tflms``, and compares the saved variables across ranks and across the two runs.
"""

from __future__ import annotations

import argparse
import os
import time

#: The images' shape (height, width, channels), as in Horovod's benchmark: no flag changes it.
IMAGE_SHAPE = (224, 224, 3)
BASE_LEARNING_RATE = 0.01


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Training throughput of a keras.applications model on synthetic data, on Horovod ranks.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default="ResNet50", help="name of the keras.applications model")
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank and step")
    parser.add_argument("--num-warmup-batches", type=int, default=10, help="untimed steps after the first one")
    parser.add_argument("--num-batches-per-iter", type=int, default=10, help="steps per timed iteration")
    parser.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    parser.add_argument("--fp16-allreduce", action="store_true", help="allreduce the gradients in float16")
    parser.add_argument("--no-cuda", action="store_true", help="train on the CPU even where there is a GPU")
    parser.add_argument("--no-tflms", action="store_true", help="compile the step with tf.function, not tflms")
    parser.add_argument(
        "--save-weights",
        metavar="PATTERN",
        help="save each rank's final model and optimizer variables to PATTERN.format(rank=<rank>) (.npz)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.no_cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = "-1"  # before TensorFlow looks for GPUs

    import horovod.tensorflow as hvd
    import keras
    import numpy as np
    import tensorflow as tf

    import tflms
    import tflms.horovod as lms_hvd

    lms_hvd.init(split_cpu=True)  # first: it splits the CPU before TensorFlow creates its devices
    rank, ranks = hvd.rank(), hvd.size()
    gpus = [] if args.no_cuda else tf.config.list_physical_devices("GPU")
    if gpus:  # one GPU per rank
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    keras.utils.set_random_seed(rank)

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    model = getattr(keras.applications, args.model)(weights=None)
    optimizer = keras.optimizers.SGD(learning_rate=BASE_LEARNING_RATE * ranks)
    images = tf.random.uniform((args.batch_size, *IMAGE_SHAPE))
    labels = tf.random.uniform((args.batch_size, 1), maxval=model.output_shape[-1], dtype=tf.int64)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    def benchmark_step(first_batch: bool) -> None:
        with tf.GradientTape() as tape:
            probabilities = model(images, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, probabilities))
        # Averages the gradients over the ranks; unlike Horovod's own, it accepts Keras 3 variables.
        tape = lms_hvd.DistributedGradientTape(tape, compression=compression)
        weights = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        if first_batch:  # after the first update, so that the optimizer's variables exist
            lms_hvd.broadcast_variables(model.variables, root_rank=0)
            lms_hvd.broadcast_variables(optimizer.variables, root_rank=0)

    step = (tf.function if args.no_tflms else tflms.function)(benchmark_step)

    def seconds_for(steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            step(first_batch=False)
        return time.perf_counter() - start

    device = "CPU" if args.no_cuda else "GPU"
    say(f"Model: {args.model}")
    say(f"Batch size: {args.batch_size}")
    say(f"Number of {device}s: {ranks}")
    with tf.device(device):
        say("Running warmup...")
        step(first_batch=True)
        seconds_for(args.num_warmup_batches)
        say("Running benchmark...")
        rates = []
        for i in range(args.num_iters):
            rates.append(args.batch_size * args.num_batches_per_iter / seconds_for(args.num_batches_per_iter))
            say(f"Iter #{i}: {rates[-1]:.1f} img/sec per {device}")
    mean, spread = np.mean(rates), 1.96 * np.std(rates)
    say(f"Img/sec per {device}: {mean:.1f} +-{spread:.1f}")
    say(f"Total img/sec on {ranks} {device}(s): {ranks * mean:.1f} +-{ranks * spread:.1f}")

    if args.save_weights:
        np.savez(args.save_weights.format(rank=rank), *[v.numpy() for v in model.variables + optimizer.variables])
        for plan in [] if args.no_tflms else step.plans:
            say(plan.summary().splitlines()[0])


if __name__ == "__main__":
    main()
