"""MemoryMonitor's limit and usage under a real 512 MiB cap.

    monitor_under_cap LOG_DIR

Run by tests/test_monitor.py; reports the event file's scalars and the
History through `emit_result`.
"""

import sys
import warnings


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    (log_dir,) = argv
    warnings.simplefilter("ignore")
    import keras
    import numpy as np
    from tensorboard.backend.event_processing import event_accumulator
    from keras_memguard.callbacks.monitor import MemoryMonitor
    from keras_memguard.testing import emit_result

    rng = np.random.default_rng(0)
    x = rng.random((4096, 1024), dtype=np.float32)
    y = rng.random((4096, 1), dtype=np.float32)
    model = keras.Sequential([
        keras.Input((1024,)),
        keras.layers.Dense(4096, activation="relu"),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(x, y, batch_size=2048, epochs=1, verbose=0,
                        callbacks=[MemoryMonitor(log_dir=log_dir)])
    acc = event_accumulator.EventAccumulator(
        log_dir + "/memguard", size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    emit_result({
        "scalars": {t: [[e.step, e.value] for e in acc.Scalars(t)]
                    for t in acc.Tags()["scalars"]},
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
    })


if __name__ == "__main__":
    main()
