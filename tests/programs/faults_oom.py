"""The out-of-memory scenarios of tests/test_faults.py, in one capped process.

    faults_oom CONSTANTS_JSON

CONSTANTS_JSON holds BATCH, FIT_MIB, QUARTER_MIB, RANDOM_BATCHES,
TWICE_STEP, TWICE_BATCHES, VAL_SAMPLES, VAL_BATCH and PLAN (a list of
{"seed", "step"}), fixed by the test so that its references agree. Reports
through `emit_result`.
"""

import json
import sys

import keras

import keras_memguard
from keras_memguard.testing import emit_result
from keras_memguard.backends.tensorflow.eval_replay import ReplayTestFunction
from keras_memguard.backends.tensorflow.replay import ReplayTrainFunction
from programs.common import collect_package_messages, weights
from programs.faults_model import make_data, make_model


class Record(keras.callbacks.Callback):
    """What the guard holds after each training batch."""

    def __init__(self, guard):
        super().__init__()
        self.guard = guard
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append([self.guard.oom_recoveries, self.guard.micro_batches])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    c = json.loads(argv[0])
    BATCH, FIT_MIB, QUARTER_MIB = c["BATCH"], c["FIT_MIB"], c["QUARTER_MIB"]
    RANDOM_BATCHES, PLAN = c["RANDOM_BATCHES"], c["PLAN"]
    TWICE_STEP, TWICE_BATCHES = c["TWICE_STEP"], c["TWICE_BATCHES"]
    VAL_SAMPLES, VAL_BATCH = c["VAL_SAMPLES"], c["VAL_BATCH"]

    messages = collect_package_messages()
    out = {}

    # (1) One batch at a random step runs out of memory: replayed in halves.
    out["random"] = []
    for entry in PLAN:
        start = entry["step"] * BATCH
        x, y = make_data(RANDOM_BATCHES, [((start, start + BATCH), FIT_MIB)],
                         seed=entry["seed"])
        model = make_model()
        guard = keras_memguard.MemoryGuard(plan=False)
        record = Record(guard)
        history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                            callbacks=[guard, record])
        out["random"].append({
            "seen": record.seen,
            "samples": history.history["samples"],
            "iterations": int(model.optimizer.iterations.numpy()),
            "weights": weights(model),
        })

    # (2) A batch that fits only in quarters: one error, replayed at quarters.
    # (5) Then two more fits with the same guard: k stays, nothing lost.
    start = TWICE_STEP * BATCH
    x, y = make_data(TWICE_BATCHES, [((start, start + BATCH), QUARTER_MIB)], seed=5)
    model = make_model()
    guard = keras_memguard.MemoryGuard(plan=False)
    fits = []
    for _ in range(3):
        before = model.train_function
        record = Record(guard)
        history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                            callbacks=[guard, record])
        after = model.train_function
        fits.append({
            "seen": record.seen,
            "samples": history.history["samples"],
            "micro_batches_log": history.history["micro_batches"],
            "restored": after is not None and not isinstance(after, ReplayTrainFunction),
            "same_function": before is None or after is before,
        })
    out["twice"] = {
        "fits": fits,
        "iterations": int(model.optimizer.iterations.numpy()),
        "weights": weights(model),
    }
    out["twice_messages"] = list(messages)

    # (3) Validation runs out of memory twice in one batch, the second time
    # after its first half was evaluated; training data is plain.
    del messages[:]
    x, y = make_data(6, [], seed=7)
    val_x, val_y = make_data(VAL_SAMPLES // BATCH, [((16, 32), FIT_MIB)], seed=8)
    model = make_model()
    guard = keras_memguard.MemoryGuard(plan=False)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        validation_data=(val_x, val_y), validation_batch_size=VAL_BATCH,
                        callbacks=[guard])
    out["validation"] = {
        "history": history.history,
        "micro_batches": guard.micro_batches,
        "oom_recoveries": guard.oom_recoveries,
        "eval_micro_batches": guard.eval_micro_batches,
        "eval_oom_recoveries": guard.eval_oom_recoveries,
        "test_function_restored": not isinstance(model.test_function, ReplayTestFunction),
        "messages": list(messages),
        "weights": weights(model),
    }

    # (3b) One ReplayTestFunction for two evaluations; the second runs out of
    # memory in its first batch, which must not bring back the first's metrics.
    model = make_model()
    function = ReplayTestFunction(model, on_out_of_memory=lambda n, k, error: 2 * k)
    function.install()
    plain_x, plain_y = make_data(VAL_SAMPLES // BATCH, [], seed=8)
    heavy_x, heavy_y = make_data(VAL_SAMPLES // BATCH, [((0, VAL_BATCH), FIT_MIB / 2)],
                                 seed=8)
    first = model.evaluate(plain_x, plain_y, batch_size=VAL_BATCH, verbose=0,
                           return_dict=True)
    second = model.evaluate(heavy_x, heavy_y, batch_size=VAL_BATCH, verbose=0,
                            return_dict=True)
    out["reuse"] = {"first": first, "second": second,
                    "micro_batches": function.micro_batches}
    function.restore()
    emit_result(out)


if __name__ == "__main__":
    main()
