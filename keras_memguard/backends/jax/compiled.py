"""Compiled micro-batched steps, one per count and batch shape, and their memory.

XLA assigns every buffer of a compiled step before it runs, so
`Compiled.memory_analysis()` tells what the step needs: its arguments (the
state and the batch), its outputs (the new state and the logs), its
temporaries, less the outputs that reuse an argument's buffer. The cache
lowers and compiles the step once per `(micro_batches, batch shapes)` and
runs the compiled executable it analysed, so planning a count costs no
second compilation when the batch then runs.
"""

import time

import jax

from keras_memguard.compiled_plan import StepMemory
from keras_memguard.decider import validate_micro_batches
from keras_memguard.backends.jax.step import make_train_step


def step_memory(compiled, micro_batches):
    """Reads a compiled step's `memory_analysis()` into a `StepMemory`.

    Args:
        compiled: A `jax.stages.Compiled`.
        micro_batches: The count it was compiled for.

    Returns:
        A `StepMemory`, or `None` when the backend gives no analysis.
    """
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None

    def read(name):
        return int(getattr(analysis, name, 0) or 0)

    return StepMemory(
        micro_batches=micro_batches,
        argument_bytes=read("argument_size_in_bytes"),
        output_bytes=read("output_size_in_bytes"),
        temp_bytes=read("temp_size_in_bytes"),
        alias_bytes=read("alias_size_in_bytes"),
        generated_code_bytes=read("generated_code_size_in_bytes"),
    )


def spec_of(tree):
    """The `jax.ShapeDtypeStruct`s of a tree of arrays (or of specs).

    A spec keeps the sharding it was given (`find_batch_size` under
    `keras.distribution`); an array's is left to `jit`.
    """

    def spec(a):
        sharding = a.sharding if isinstance(a, jax.ShapeDtypeStruct) else None
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    return jax.tree_util.tree_map(spec, tree)


def shape_key(data):
    """A hashable key of a batch's structure, shapes and dtypes."""
    leaves, treedef = jax.tree_util.tree_flatten(data)
    return treedef, tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves)


class StepCache:
    """Compiled micro-batched steps of one model, per count and batch shapes.

    Steps are compiled for the state's shapes at first use; call `clear()`
    when the model's variables change (a new optimizer, a `compile()`).

    Args:
        model: A compiled Keras model on the JAX backend.

    Example:

    ```python
    cache = StepCache(model)
    memory = cache.memory(4, state, batch)  # compiles, runs nothing
    print(memory.need_bytes)
    logs, state = cache.compiled(4, state, batch)(state, batch)  # no recompile
    ```
    """

    def __init__(self, model):
        self.model = model
        self._functions = {}
        self._compiled = {}
        self._memory = {}
        # Seconds spent lowering and compiling, per (count, shapes).
        self.compile_seconds = {}

    def function(self, micro_batches):
        """The jitted, non-donating step for a count (`make_train_step`)."""
        function = self._functions.get(micro_batches)
        if function is None:
            function = make_train_step(self.model, validate_micro_batches(micro_batches))
            self._functions[micro_batches] = function
        return function

    def compiled(self, micro_batches, state, data):
        """The compiled step for a count and the batch's shapes.

        Args:
            micro_batches: The number of micro-batches, an `int` >= 1.
            state: The state tuple, arrays or `jax.ShapeDtypeStruct`s.
            data: The batch, arrays or `jax.ShapeDtypeStruct`s.

        Returns:
            A `jax.stages.Compiled`, callable as `(state, data) -> (logs,
            state)` on arrays of those shapes.
        """
        key = (micro_batches, shape_key(data))
        compiled = self._compiled.get(key)
        if compiled is None:
            start = time.perf_counter()
            lowered = self.function(micro_batches).lower(spec_of(state), spec_of(data))
            compiled = lowered.compile()
            self.compile_seconds[key] = time.perf_counter() - start
            self._compiled[key] = compiled
        return compiled

    def memory(self, micro_batches, state, data):
        """What the step for a count needs on the batch's shapes.

        Compiles the step (cached), runs nothing.

        Args:
            micro_batches: The number of micro-batches, an `int` >= 1.
            state: The state tuple, arrays or `jax.ShapeDtypeStruct`s.
            data: The batch, arrays or `jax.ShapeDtypeStruct`s.

        Returns:
            A `StepMemory`, or `None` when the backend gives no analysis.
        """
        key = (micro_batches, shape_key(data))
        if key not in self._memory:
            self._memory[key] = step_memory(
                self.compiled(micro_batches, state, data), micro_batches
            )
        return self._memory[key]

    def compiled_memory(self, micro_batches, data):
        """The `StepMemory` of a step already compiled for a count and batch
        shapes, or `None` when there is none (never compiles).

        What a step that ran out of memory needed, where it compiled.
        """
        key = (micro_batches, shape_key(data))
        if key not in self._memory and key in self._compiled:
            self._memory[key] = step_memory(self._compiled[key], micro_batches)
        return self._memory.get(key)

    def analysed(self, micro_batches, data):
        """The `StepMemory` already read for a count and batch shapes, or `None`.

        Never compiles: what a step that ran was planned with.
        """
        return self._memory.get((micro_batches, shape_key(data)))

    def keys(self):
        """The `(micro_batches, shape key)` pairs compiled so far."""
        return tuple(self._compiled)

    def forget_programs(self):
        """Forgets the compiled steps, keeping what each needs in memory.

        After what the step computes changed at the same shapes (losses
        marked to be counted whole): the next use traces again.
        """
        self._functions.clear()
        self._compiled.clear()

    def clear(self):
        """Forgets every compiled step (after the model's variables change)."""
        self._functions.clear()
        self._compiled.clear()
        self._memory.clear()
        self.compile_seconds.clear()
