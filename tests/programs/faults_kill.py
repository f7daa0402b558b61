"""A guarded run killed with SIGKILL mid-run, then resumed through
`keras.callbacks.BackupAndRestore` (tests/test_faults.py).

    faults_kill CONSTANTS_JSON BACKUP_DIR kill|resume

CONSTANTS_JSON holds BATCH and FIT_MIB. With `kill`, the process kills
itself in epoch 1 after batch 6; with `resume`, it trains to the end and
reports through `emit_result`.
"""

import json
import os
import signal
import sys

import keras

import keras_memguard
from keras_memguard.testing import emit_result
from programs.faults_model import make_data, make_model

EPOCHS = 3


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    c = json.loads(argv[0])
    BATCH, FIT_MIB = c["BATCH"], c["FIT_MIB"]
    BACKUP = argv[1]
    KILL = argv[2] == "kill"
    start = 2 * BATCH
    x, y = make_data(10, [((start, start + BATCH), FIT_MIB)], seed=9)
    model = make_model()
    model(x[:1])  # BackupAndRestore needs a built model

    EPOCH = [0]
    SEEN = []
    guard = keras_memguard.MemoryGuard(backup_dir=BACKUP, plan=False)

    class Kill(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.params and EPOCH[0] == 1 and batch == 6:
                print("killed at", EPOCH[0], batch, guard.micro_batches,
                      guard.oom_recoveries, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_epoch_begin(self, epoch, logs=None):
            EPOCH[0] = epoch

    class Seen(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            SEEN.append([guard.micro_batches, guard.oom_recoveries])

    callbacks = [keras.callbacks.BackupAndRestore(BACKUP, save_freq=3), guard, Seen()]
    if KILL:
        callbacks.append(Kill())
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=callbacks)
    emit_result({
        "seen": SEEN,
        "epochs": history.epoch,
        "samples": history.history["samples"],
        "micro_batches": guard.micro_batches,
        "oom_recoveries": guard.oom_recoveries,
        "weights": [w.tolist() for w in model.get_weights()],
    })


if __name__ == "__main__":
    main()
