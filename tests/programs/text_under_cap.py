"""Length-bucketed text under a real 200 MiB cap: plan every bucket, no error.

The convolutional text classifier of `programs.common` at batch 256 with
six bucket lengths from 64 to 512 tokens in shuffled order. Plain training
does not fit the longest bucket under this cap; the guard plans each batch
from its length. Afterwards the same process shows that plain training of
the longest bucket does run out of memory here. Reports through
`emit_result`.
"""

import tensorflow as tf

import keras_memguard
from keras_memguard.testing import emit_result
from programs.common import MicroBatchCounts
from programs.common import SampleCount
from programs.common import bucketed_text
from programs.common import collect_package_messages
from programs.common import text_classifier
from programs.common import TEXT_BATCH
from programs.common import TEXT_LENGTHS



def main():
    messages = collect_package_messages()
    dataset, order = bucketed_text()
    ks = MicroBatchCounts()
    guard = keras_memguard.MemoryGuard()
    model = text_classifier(metrics=[SampleCount()])
    history = model.fit(dataset, epochs=1, verbose=0, callbacks=[ks, guard])
    # The cap bites: plain training of one batch of the longest bucket.
    plain = text_classifier()
    longest, _ = bucketed_text(repeats=1, lengths=TEXT_LENGTHS[-1:])
    try:
        plain.fit(longest, epochs=1, verbose=0)
        plain_error = None
    except tf.errors.ResourceExhaustedError as error:
        plain_error = type(error).__name__
    emit_result({
        "samples": history.history["samples"],
        "batches": len(order),
        "batch": TEXT_BATCH,
        "lengths": order,
        "ks": ks.ks,
        "oom_recoveries": guard.oom_recoveries,
        "plain_error": plain_error,
        "messages": list(messages),
    })


if __name__ == "__main__":
    main()
