"""The PyTorch memory probe, the monitor and the guard on a real NVIDIA GPU.

For a machine with an NVIDIA GPU and torch built with CUDA (Keras on its
PyTorch backend; TensorFlow is not needed). Each part runs in a process of
its own, so that CUDA's caching allocator and its per-process memory
fraction start clean:

- `probe`: with 1 GiB held by this process and 512 MiB allocated and freed
  in between, `TorchMemoryProbe` (current, interval peak, reserved, limit)
  against torch's own `memory_allocated`/`memory_reserved`, and `NvmlProbe`
  against `nvidia-smi --query-gpu=memory.used,memory.total`; and the cost
  of one reading (the probe's, torch's `memory_stats` and its nested form,
  NVML's). Without CUDA it says so and reads the host instead (the probe's
  CPU path), exiting 0: a smoke run anywhere.
- `monitor`: a short `fit` of a small CNN with `MemoryMonitor`; the peak of
  each batch as the logs carry it, and the epoch's.
- `guard`: `run_guard(guard, ...)` trains under
  `torch.cuda.set_per_process_memory_fraction` (the limit `--limit-mib`),
  at a batch that does not fit it in one piece, with the given
  `MemoryGuard`; prints the out-of-memory errors recovered from, the
  micro-batch counts, the peak, and an error that escaped `fit`, if any.
- `own_step`: a CNN class with a `train_step` of its own (Keras' step, its
  loss halved, one more log), trained by plain `fit` and under
  `MemoryGuard` from the same weights at a batch that fits: the largest
  weight difference (relative to the weight's largest magnitude), both
  runs' logs. On CUDA then, under the
  limit `--limit-mib`, a batch that does not fit: what plain `fit` raises,
  what the guard raises, and whether the guarded model then trains a
  smaller batch in the same process. Without CUDA the first half runs on
  the CPU (a smoke run).

Prints one JSON line per figure: `{"part", "figure", "value", "unit"}`.

Run: python bench/torch_backend/bench_torch_gpu.py [--parts probe,monitor,guard,own_step]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import timeit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARTS = ("probe", "monitor", "guard", "own_step")
# Seconds each part's process may take: together under five minutes.
PART_TIMEOUT_S = {"probe": 50, "monitor": 50, "guard": 75, "own_step": 90}
_MIB = 2**20


def emit(part, figure, value, unit=None):
    """Prints one figure as a JSON line."""
    if isinstance(value, float):
        value = round(value, 3)
    print(json.dumps({"part": part, "figure": figure, "value": value, "unit": unit}), flush=True)


def _mib(num_bytes):
    return None if num_bytes is None else num_bytes / _MIB


def _per_call_us(function, number):
    """Median over five repeats of the time of one call, in microseconds."""
    times = timeit.repeat(function, number=number, repeat=5)
    return sorted(times)[2] / number * 1e6


def nvidia_smi():
    """`memory.used`, `memory.total` of GPU 0 and this process's use, in MiB."""
    gpu = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True, timeout=20,
    ).stdout.splitlines()[0]
    apps = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True, timeout=20,
    ).stdout
    used, total = (float(v) for v in gpu.split(","))
    mine = [float(line.split(",")[1]) for line in apps.splitlines()
            if line.strip() and int(line.split(",")[0]) == os.getpid()]
    return used, total, mine[0] if mine else None


def part_probe():
    import torch

    from keras_memguard.backends.torch.probe import TorchMemoryProbe
    from keras_memguard.probes.nvml import NvmlProbe

    emit("probe", "torch_version", torch.__version__)
    if not torch.cuda.is_available():
        print("CUDA is absent: the probe part reads the host's resident memory "
              "(the probe's CPU path) instead.", flush=True)
        emit("probe", "cuda_available", False)
        probe = TorchMemoryProbe(devices=["CPU:0"], memory_limit=64 * 2**30)
        probe.reset()
        held = torch.ones(64 * _MIB // 4)
        del held
        (sample,) = probe.sample()
        emit("probe", "host_mode", probe.mode)
        emit("probe", "host_current", _mib(sample.current_bytes), "MiB")
        emit("probe", "host_interval_peak_after_64MiB_freed", _mib(sample.peak_bytes), "MiB")
        emit("probe", "probe_sample_cost", _per_call_us(probe.sample, 2000), "us")
        probe.close()
        return

    index = torch.cuda.current_device()
    emit("probe", "gpu", torch.cuda.get_device_name(index))
    device = torch.device("cuda", index)
    probe = TorchMemoryProbe(devices=[device])
    probe.reset()
    held = torch.empty(256 * _MIB, dtype=torch.float32, device=device)  # 1 GiB
    held.fill_(1.0)
    transient = torch.empty(128 * _MIB, dtype=torch.float32, device=device)  # 512 MiB
    transient.fill_(1.0)
    del transient
    torch.cuda.synchronize(device)
    (sample,) = probe.sample()
    emit("probe", "held", 1024.0, "MiB")
    emit("probe", "probe_current", _mib(sample.current_bytes), "MiB")
    emit("probe", "torch_memory_allocated", _mib(torch.cuda.memory_allocated(index)), "MiB")
    emit("probe", "probe_interval_peak_with_512MiB_freed", _mib(sample.peak_bytes), "MiB")
    emit("probe", "probe_reserved", _mib(probe.reserved_bytes(probe.devices[0])), "MiB")
    emit("probe", "torch_memory_reserved", _mib(torch.cuda.memory_reserved(index)), "MiB")
    emit("probe", "probe_limit", _mib(sample.limit_bytes), "MiB")
    emit("probe", "probe_limit_source", probe.limit_source(probe.devices[0]))
    (after,) = probe.sample()
    emit("probe", "probe_next_interval_peak", _mib(after.peak_bytes), "MiB")

    nvml = NvmlProbe(tf_gpu_ordinals=[i for i in probe.cuda_indices if i is not None])
    readings = nvml.sample()
    if readings:
        (reading,) = readings
        emit("probe", "nvml_index", reading.nvml_index)
        emit("probe", "nvml_total", _mib(reading.total_bytes), "MiB")
        emit("probe", "nvml_used", _mib(reading.used_bytes), "MiB")
        emit("probe", "nvml_process", _mib(reading.process_bytes), "MiB")
    else:
        emit("probe", "nvml_available", False)
    try:
        used, total, mine = nvidia_smi()
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        emit("probe", "nvidia_smi_error", str(error))
    else:
        emit("probe", "smi_used", used, "MiB")
        emit("probe", "smi_total", total, "MiB")
        emit("probe", "smi_process", mine, "MiB")
        if mine is not None:
            emit("probe", "smi_process_minus_probe_reserved",
                 mine - _mib(probe.reserved_bytes(probe.devices[0])), "MiB")

    emit("probe", "probe_sample_cost", _per_call_us(probe.sample, 2000), "us")
    emit("probe", "torch_memory_stats_cost",
         _per_call_us(lambda: torch.cuda.memory_stats(index), 2000), "us")
    emit("probe", "torch_memory_stats_nested_cost",
         _per_call_us(lambda: torch.cuda.memory_stats_as_nested_dict(index), 2000), "us")
    emit("probe", "torch_reset_peak_cost",
         _per_call_us(lambda: torch.cuda.reset_peak_memory_stats(index), 2000), "us")
    if readings:
        emit("probe", "nvml_sample_cost", _per_call_us(nvml.sample, 200), "us")
    nvml.close()
    del held


def _cnn(keras, size):
    """Two 3x3 Conv2D(64) on `size`x`size`x3, pooled, ten classes."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((size, size, 3)),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(batch, steps, size):
    import numpy as np

    rng = np.random.default_rng(0)
    return (rng.normal(size=(batch * steps, size, size, 3)).astype("float32"),
            rng.integers(0, 10, size=(batch * steps,)))


def part_monitor():
    import keras
    import torch

    import keras_memguard

    cuda = torch.cuda.is_available()
    batch, steps, size = (128, 8, 64) if cuda else (16, 4, 16)
    if not cuda:
        print("CUDA is absent: the monitor part trains a small model on the CPU "
              "and logs the host's resident memory.", flush=True)
    x, y = _data(batch, steps, size)
    peaks = []

    class Peaks(keras.callbacks.Callback):
        def on_train_batch_end(self, batch_index, logs=None):
            peaks.append((logs or {}).get("memory_peak_mib"))

    with tempfile.TemporaryDirectory() as log_dir:
        monitor = keras_memguard.MemoryMonitor(log_dir=log_dir, memory_limit=None)
        history = _cnn(keras, size).fit(x, y, batch_size=batch, epochs=1, verbose=0,
                                        callbacks=[monitor, Peaks()])
    emit("monitor", "device", "cuda" if cuda else "cpu")
    emit("monitor", "batch_size", batch)
    for i, peak in enumerate(peaks):
        emit("monitor", f"batch_{i}_peak", peak, "MiB")
    emit("monitor", "epoch_peak", history.history.get("memory_peak_mib", [None])[0], "MiB")
    emit("monitor", "epoch_usage", history.history.get("memory_usage", [None])[0])


# --- guard --------------------------------------------------------------
# Another part of the library makes `MemoryGuard` work on the PyTorch
# backend; `run_guard` takes a guard made by the caller, so this part runs
# unchanged once it does.


def run_guard(guard, limit_mib=1024.0, batch=512, steps=4, size=64):
    """Trains under a per-process memory fraction with the given guard.

    The CNN's step at `batch` needs several GiB in one piece, far over
    `limit_mib`, so the guard has to split it (or recover from the
    out-of-memory error) to get through.

    Args:
        guard: A `keras_memguard.MemoryGuard`, not yet used.
        limit_mib: The memory the allocator may reserve, in MiB, set with
            `torch.cuda.set_per_process_memory_fraction`. Defaults to `1024`.
        batch: The batch size. Defaults to `512`.
        steps: Batches per epoch. Defaults to `4`.
        size: Image side. Defaults to `64`.

    Returns:
        A dict of what was printed.
    """
    import keras
    import torch

    import keras_memguard

    index = torch.cuda.current_device()
    _, total = torch.cuda.mem_get_info(index)
    fraction = limit_mib * _MIB / total
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    x, y = _data(batch, steps, size)
    model = _cnn(keras, size)
    monitor = keras_memguard.MemoryMonitor()
    error = history = None
    try:
        history = model.fit(x, y, batch_size=batch, epochs=2, verbose=0,
                            callbacks=[monitor, guard])
    except Exception as e:  # The figure to report: what escaped the guard.
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    logs = {} if history is None else history.history
    result = {
        "limit": limit_mib,
        "fraction": fraction,
        "batch_size": batch,
        "error": error,
        "oom_recoveries": getattr(guard, "oom_recoveries", None),
        "micro_batches_last": getattr(guard, "micro_batches", None),
        "micro_batches_per_epoch": logs.get("micro_batches"),
        "epoch_peaks": logs.get("memory_peak_mib"),
        "epoch_usage": logs.get("memory_usage"),
        "loss": logs.get("loss"),
    }
    units = {"limit": "MiB", "epoch_peaks": "MiB"}
    for figure, value in result.items():
        emit("guard", figure, value, units.get(figure))
    return result


def part_guard(limit_mib, batch):
    import torch

    if not torch.cuda.is_available():
        print("CUDA is absent: the guard part needs a CUDA device; skipped.", flush=True)
        return
    try:
        import keras_memguard

        guard = keras_memguard.MemoryGuard(plan_cache=False)
    except Exception as error:  # The guard may not take the torch backend yet.
        emit("guard", "guard_unavailable", f"{type(error).__name__}: {error}")
        return
    run_guard(guard, limit_mib=limit_mib, batch=batch)


def _own_step_cnn(keras, size):
    """`_cnn`'s layers in a class whose `train_step` is its own."""

    class OwnStepCNN(keras.Sequential):
        def train_step(self, data):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            y_pred = self(x, training=True)
            loss = 0.5 * self.compute_loss(x=x, y=y, y_pred=y_pred,
                                           sample_weight=sample_weight)
            self.zero_grad()
            loss.backward()
            weights = self.trainable_weights
            self.optimizer.apply([w.value.grad for w in weights], weights)
            return {"half_loss": loss.detach(), "own": 1.0}

    layers = _cnn(keras, size).layers
    keras.utils.set_random_seed(0)
    model = OwnStepCNN([keras.Input((size, size, 3))] + [
        type(layer).from_config(layer.get_config()) for layer in layers])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _fit_error(model, x, y, batch, callbacks):
    try:
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=callbacks)
    except Exception as e:  # The figure to report: what `fit` raised.
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return None


def part_own_step(limit_mib, batch):
    import keras
    import numpy as np
    import torch

    import keras_memguard

    cuda = torch.cuda.is_available()
    small, steps, size = (64, 4, 64) if cuda else (16, 2, 16)
    emit("own_step", "device", "cuda" if cuda else "cpu")
    x, y = _data(small, steps, size)
    plain, guarded = _own_step_cnn(keras, size), _own_step_cnn(keras, size)
    fit = dict(batch_size=small, epochs=2, verbose=0, shuffle=False)
    keras.utils.set_random_seed(1)
    want = plain.fit(x, y, **fit).history
    guard = keras_memguard.MemoryGuard(memory_limit=None if cuda else 2**34, plan_cache=False)
    keras.utils.set_random_seed(1)
    got = guarded.fit(x, y, callbacks=[guard], **fit).history
    # Each weight's largest difference against its largest magnitude.
    difference = max(
        float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-12))
        for a, b in zip(plain.get_weights(), guarded.get_weights())
    )
    emit("own_step", "batch_size_fits", small)
    emit("own_step", "plain_half_loss", want.get("half_loss"))
    emit("own_step", "guard_half_loss", got.get("half_loss"))
    emit("own_step", "guard_own_log", got.get("own"))
    emit("own_step", "guard_micro_batches", got.get("micro_batches"))
    emit("own_step", "largest_relative_weight_difference", difference)
    if not cuda:
        print("CUDA is absent: the own_step part's out-of-memory half needs a "
              "CUDA device; skipped.", flush=True)
        return
    index = torch.cuda.current_device()
    _, total = torch.cuda.mem_get_info(index)
    torch.cuda.set_per_process_memory_fraction(limit_mib * _MIB / total, index)
    x, y = _data(batch, 2, size)
    emit("own_step", "limit", limit_mib, "MiB")
    emit("own_step", "batch_size_too_large", batch)
    emit("own_step", "plain_error", _fit_error(_own_step_cnn(keras, size), x, y, batch, []))
    torch.cuda.empty_cache()
    model = _own_step_cnn(keras, size)
    guard = keras_memguard.MemoryGuard(plan_cache=False)
    emit("own_step", "guard_error", _fit_error(model, x, y, batch, [guard]))
    torch.cuda.empty_cache()
    emit("own_step", "guard_then_fits_at", small)
    emit("own_step", "guard_then_error",
         _fit_error(model, x[: small * 2], y[: small * 2], small,
                    [keras_memguard.MemoryGuard(plan_cache=False)]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--limit-mib", type=float, default=1024.0,
                        help="the memory limit of part guard, in MiB")
    parser.add_argument("--batch-size", type=int, default=512,
                        help="the batch size of part guard")
    parser.add_argument("--in-process", choices=PARTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_process:
        if ROOT not in sys.path:
            sys.path.insert(0, ROOT)
        {"probe": part_probe,
         "monitor": part_monitor,
         "guard": lambda: part_guard(args.limit_mib, args.batch_size),
         "own_step": lambda: part_own_step(args.limit_mib, args.batch_size)}[args.in_process]()
        return
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        sys.exit(f"unknown parts {unknown}; choose from {list(PARTS)}")
    env = dict(os.environ, KERAS_BACKEND="torch")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    failed = []
    for part in parts:
        try:
            result = subprocess.run(
                [sys.executable, __file__, "--in-process", part,
                 "--limit-mib", str(args.limit_mib), "--batch-size", str(args.batch_size)],
                env=env, timeout=PART_TIMEOUT_S[part], check=False,
            )
        except subprocess.TimeoutExpired:
            emit(part, "timed_out_after", PART_TIMEOUT_S[part], "s")
            failed.append(part)
            continue
        if result.returncode != 0:
            emit(part, "exit_code", result.returncode)
            failed.append(part)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
