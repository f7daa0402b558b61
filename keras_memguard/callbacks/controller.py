"""What `MemoryGuard` decides, kept apart from Keras: testable without `fit`.

The controller owns the decider's configuration and state, plans each
batch, learns from each batch's reading and from out-of-memory errors,
and keeps the rungs' bookkeeping and what is saved between runs. It takes
plain numbers (bytes, sample counts) and returns the decider's `Plan`s and
log lines; the guard feeds it from Keras' hooks and applies what it says.
"""

import json
import logging
import os

from keras_memguard import decider
from keras_memguard import plan_cache
from keras_memguard.callbacks import messages

logger = logging.getLogger("keras_memguard")

# The guard's state in a `backup_dir` (shared with BackupAndRestore).
STATE_FILE = "memguard_state.json"
STATE_FILE_VERSION = 2


class GuardController:
    """Plans, observes and replays for one `MemoryGuard`.

    Args:
        config: A `keras_memguard.decider.DeciderConfig`.
        micro_batches: The count to start with, or `None` for the
            decider's default (`first_split` when planning, else 1).
        escalate: The rungs the guard may climb, a tuple of names.
        backup_dir: The directory `save_state` writes to and `load_state`
            reads from, or `None` to keep the state in memory only.

    Example:

    >>> from keras_memguard import decider
    >>> controller = GuardController(decider.make_config())
    >>> controller.start(limit_bytes=1000.0)
    >>> controller.plan(batch_size=64, sample_size=1.0, in_use_bytes=0.0)
    8
    """

    def __init__(self, config, micro_batches=None, escalate=(), backup_dir=None):
        self.config = config
        self.backup_dir = backup_dir
        self.state = decider.init(config, micro_batches)
        self.escalate = tuple(escalate)
        self.limit_bytes = None
        # The rungs switched on, and those refused with why.
        self.rungs_on = ()
        self.rungs_refused = {}
        # The last plan: (state, batch_size, sample_size, planned in use, k).
        self._memo = None
        # The plan cache entry this set-up's state is kept under, or None.
        self.plan_key = None
        self._plan_fields = None

    def start(self, limit_bytes, fixed_bytes=0.0, sample_bytes=0.0, state=None):
        """Starts a `fit`: the limit planned against, and what is known.

        Args:
            limit_bytes: The device memory limit planned against.
            fixed_bytes: The step's memory that does not shrink with the
                micro-batch (the gradients' bytes).
            sample_bytes: The bytes of one sample's layer outputs (0:
                unknown).
            state: A `DeciderState` to go on from (saved state or the plan
                cache), or `None` to keep the current one.
        """
        self.limit_bytes = float(limit_bytes)
        if state is not None:
            self.state = state
        self.state = self.state._replace(
            fixed_bytes=float(fixed_bytes), sample_bytes=float(sample_bytes)
        )
        self._memo = None

    def plan(self, batch_size, sample_size, in_use_bytes):
        """The count to run a batch with; logs a line when it changes.

        Returns:
            The micro-batch count, an int.
        """
        memo = self._memo
        state = self.state
        # The plan depends on the memory in use only through this value.
        planned_in_use = decider.in_use_planned_for(state, in_use_bytes)
        if (
            memo is not None
            and memo[0] is state
            and memo[1] == batch_size
            and memo[2] == sample_size
            and memo[3] == planned_in_use
        ):
            return memo[4]
        decided, self.state = decider.plan(
            self.config,
            state,
            decider.Batch(batch_size, sample_size, in_use_bytes, self.limit_bytes),
        )
        k = decided.micro_batches
        if decided.changed:
            messages.log_plan(decided, batch_size)
        self._memo = (self.state, batch_size, sample_size, planned_in_use, k)
        return k

    @property
    def needs_sample_bytes(self):
        """Whether the first plan still lacks one sample's layer outputs.

        True while nothing is known or measured (no layer outputs from the
        static shapes, no reading, no error): only then is a traced forward
        pass worth running, for the first batch of a model whose shapes tell
        nothing, not for every batch.
        """
        state = self.state
        return not (state.sample_bytes or state.readings or state.failures)

    def set_sample_bytes(self, sample_bytes):
        """Sets one sample's layer outputs (0: unknown) for the first plan."""
        self.state = self.state._replace(sample_bytes=float(sample_bytes))

    def one_sample_fits(self, batch_size, sample_size, in_use_bytes):
        """Whether one sample per micro-batch is predicted to fit now."""
        return decider.one_sample_fits(
            self.config,
            self.state,
            decider.Batch(batch_size, sample_size, in_use_bytes, self.limit_bytes),
        )

    def observe(self, reading):
        """Learns a batch's reading; returns the decider's `Plan` for the next."""
        decided, self.state = decider.observe(self.config, self.state, reading)
        return decided

    def fail(self, failure):
        """Learns an out-of-memory error; returns the replay's `Plan`."""
        decided, self.state = decider.fail(self.config, self.state, failure)
        return decided

    def fail_evaluation(self, batch_size, micro_batches):
        """Learns a validation batch's error; returns the slices' `Plan`."""
        decided, self.state = decider.fail_evaluation(
            self.config, self.state, batch_size, micro_batches
        )
        return decided

    def count_replay(self):
        """Counts a replay that kept the count (a rung was climbed)."""
        self.state = self.state._replace(oom_count=self.state.oom_count + 1)

    def set_micro_batches(self, micro_batches):
        """Puts `micro_batches` in force (restoring, or after a rung)."""
        self.state = self.state._replace(micro_batches=int(micro_batches))

    def next_rung(self, can_climb):
        """The next rung of `escalate` to switch on, or `None`.

        Args:
            can_climb: Called as `can_climb(rung)`; returns `None` when the
                rung can work on the model, else why not (recorded once).
        """
        for rung in self.escalate:
            if rung in self.rungs_on or rung in self.rungs_refused:
                continue
            reason = can_climb(rung)
            if reason is not None:
                self.rungs_refused[rung] = reason
                continue
            self.rungs_on += (rung,)
            return rung
        return None

    def restart_model(self):
        """Forgets the memory model (the step changed, e.g. a rung is on)."""
        self.state = self.state._replace(
            readings=(), peaks=(), failures=(), failed_allocation=None, shapes=()
        )
        self._memo = None

    def load_plan(self, fields):
        """Keys the plan cache by the set-up `fields`; its saved state, or `None`."""
        self._plan_fields = fields
        self.plan_key = plan_cache.setup_key(fields)
        state = plan_cache.load(self.plan_key, fields)
        if state is not None:
            messages.log_cached_plan(len(state.readings), plan_cache.path_for(self.plan_key))
        return state

    def save_plan(self):
        """Writes the state to the plan cache entry, where there is one."""
        if self.plan_key is not None:
            plan_cache.save(self.plan_key, self._plan_fields, self.state)

    def save_state(self, step, setup=None):
        """`save` to `backup_dir`, where there is one."""
        if self.backup_dir is not None:
            self.save(self.backup_dir, step, setup)

    def load_state(self, setup=None):
        """`load` from `backup_dir`: its batch counter, or `None`."""
        return self.load(self.backup_dir, setup) if self.backup_dir is not None else None

    def save(self, directory, step, setup=None):
        """Writes the state and the batch counter to `directory` atomically.

        `setup` (JSON-serializable, or `None`) names the training step the
        state was learned on; `load` ignores a state of another.
        """
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, STATE_FILE)
        payload = {
            "version": STATE_FILE_VERSION,
            "decider": decider.to_dict(self.state),
            "step": step,
            "setup": setup,
        }
        with open(path + ".tmp", "w") as f:
            json.dump(payload, f)
        os.replace(path + ".tmp", path)

    def load(self, directory, setup=None):
        """Restores what `save` wrote; returns its batch counter, or `None`.

        A file written by another version of the package is ignored with
        one warning; one saved with another `setup` than a given one (a
        hyperparameter search's next trial, with the same `backup_dir`)
        with one log line: its readings describe another step.
        """
        path = os.path.join(directory, STATE_FILE)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            payload = json.load(f)
        if not isinstance(payload, dict) or payload.get("version") != STATE_FILE_VERSION:
            logger.warning(
                "MemoryGuard ignores %s: it was written by another version "
                "of keras_memguard; the guard starts afresh.",
                path,
            )
            return None
        saved = payload.get("setup")
        if setup is not None and saved is not None and saved != setup:
            logger.info(
                "MemoryGuard does not go on from %s: it was saved while "
                "training another model or set-up; the guard starts afresh.",
                path,
            )
            return None
        self.state = decider.inherit(decider.from_dict(payload["decider"]))
        return payload.get("step", 0)
