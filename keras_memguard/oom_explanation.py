"""Why a batch ran out of memory: the failed allocation and what held memory.

At an out-of-memory error, TensorFlow's BFC allocator (GPUs, and the capped
CPU allocator) writes a `MemoryDump` to `<TF_BFC_MEMORY_DUMP>_<allocator>.<us>`
when that variable is set: every chunk of its regions, in use or free, with
the bytes requested. The error's message names the failed allocation (shape,
dtype, device) and the op that asked for it. Neither names the layers that
held memory (chunks carry no op names outside TensorFlow 1's timestamped
allocator), so live chunks are matched by size against the tensors of the
failed micro-batch: each layer's output, the input batch, weights and
optimizer state.

`capture_memory_dumps` turns the dumps on for a `fit`; `explain` builds an
`OutOfMemoryExplanation` from what is known, missing values staying `None`.
"""

import atexit
import contextlib
import glob
import json
import math
import os
import re
import shutil
import tempfile
import time
from typing import NamedTuple, Optional, Tuple

import keras

from keras_memguard.backends import compat

MEMORY_DUMP_VARIABLE = "TF_BFC_MEMORY_DUMP"
_MIB = 1024 * 1024
_LARGEST_TENSORS = 5

_DTYPE_BYTES = {
    "float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2,
    "double": 8, "float64": 8, "int8": 1, "uint8": 1, "int16": 2,
    "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
    "bool": 1, "complex64": 8, "complex128": 16,
}
_DTYPE_NAMES = {"float": "float32", "half": "float16", "double": "float64"}
_FAILED_ALLOCATION = re.compile(
    r"OOM when allocating tensor with shape\s*\[([0-9, ]*)\] and type (\w+)"
    r"(?: on (\S+))?(?: by allocator (\S+))?"
)
_NODE = re.compile(r"\{\{node ([^}]+)\}\}|Detected at node '?([^\s']+)")


class TensorEntry(NamedTuple):
    """A live allocation at the failure.

    Attributes:
        bytes: The bytes requested.
        layers: The layers whose tensors have exactly this size (several
            when layers share a shape; empty when none matches).
        kind: `"output"`, `"input"`, `"weights"`, `"optimizer state"`, or
            `None` when nothing matches.
        shape: The matched tensor's shape, or `None`.
    """

    bytes: int
    layers: Tuple[str, ...]
    kind: Optional[str]
    shape: Optional[Tuple[int, ...]]


class OutOfMemoryExplanation(NamedTuple):
    """What ran out of memory, and what held it; `None` where unknown.

    Attributes:
        step: The guard's global batch counter at the failure.
        batch_size: The batch's samples (each replica's part).
        micro_batches: The count that failed.
        micro_batch_size: Samples per micro-batch at the failure.
        replayed_with: The count the batch is replayed with.
        failed_allocation_bytes: Size of the allocation that failed.
        failed_shape: Its shape.
        failed_dtype: Its dtype.
        failed_op: The op that asked for it.
        failed_layer: The layer of that op.
        backward: Whether the op belongs to the backward pass.
        device: The device the allocation was for.
        limit_bytes: The device's memory limit.
        in_use_bytes: Bytes in use when the allocation failed.
        largest_free_chunk_bytes: The largest single free block: a free chunk
            in the allocator's regions or the memory no region holds yet.
        fragmentation: `1 - largest_free / free` (0 when the free memory
            is one block).
        largest_tensors: Up to five `TensorEntry`, largest first.
        source: `"bfc_memory_dump"` when the allocator's dump was read,
            else `"error_message"`.
    """

    step: int
    batch_size: Optional[int]
    micro_batches: int
    micro_batch_size: Optional[int]
    replayed_with: Optional[int]
    failed_allocation_bytes: Optional[int]
    failed_shape: Optional[Tuple[int, ...]]
    failed_dtype: Optional[str]
    failed_op: Optional[str]
    failed_layer: Optional[str]
    backward: Optional[bool]
    device: Optional[str]
    limit_bytes: Optional[int]
    in_use_bytes: Optional[int]
    largest_free_chunk_bytes: Optional[int]
    fragmentation: Optional[float]
    largest_tensors: Tuple[TensorEntry, ...]
    source: str

    @property
    def demand_bytes(self):
        """In-use bytes plus the failed allocation: memory the step needed."""
        if self.in_use_bytes is None or self.failed_allocation_bytes is None:
            return None
        return self.in_use_bytes + self.failed_allocation_bytes

    @property
    def fitting_fraction(self):
        """The share of the failed allocation the largest free block held.

        Only when the memory was there but not in one piece (in use plus
        the allocation under the limit); `None` otherwise. A micro-batch
        this fraction of the failed one asks for allocations that fit.
        """
        demand = self.demand_bytes
        if demand is None or not self.limit_bytes or demand >= self.limit_bytes:
            return None
        if not self.failed_allocation_bytes or self.largest_free_chunk_bytes is None:
            return None
        fraction = self.largest_free_chunk_bytes / self.failed_allocation_bytes
        return fraction if fraction < 1 else None


class MemoryDumpCapture:
    """Where the allocator writes its dumps during a `fit`, and reading them.

    When the user set `TF_BFC_MEMORY_DUMP` already, their files are read and
    kept; otherwise the dumps go to a temporary directory named after this
    process, removed by `close()`. TensorFlow reads the variable at each
    failure, so setting it after TensorFlow started works. The allocator may
    write many dumps while it retries; `take_latest` reads the newest and
    deletes every other, and a directory left by a process that was killed
    (its process id no longer runs) is swept when the next capture starts,
    so dumps never pile up.
    """

    def __init__(self):
        self._previous = os.environ.get(MEMORY_DUMP_VARIABLE)
        self._directory = None
        if self._previous:
            self.prefix = self._previous
        else:
            sweep_stale_dump_directories()
            self._directory = tempfile.mkdtemp(prefix=f"{_DUMP_DIRECTORY}{os.getpid()}-")
            self.prefix = os.path.join(self._directory, "memory")
            os.environ[MEMORY_DUMP_VARIABLE] = self.prefix
            # A `fit` that raises never reaches `on_train_end`.
            atexit.register(self.close)
        self._seen = set(self._files())

    def _files(self):
        return glob.glob(glob.escape(self.prefix) + "_*")

    def take_latest(self):
        """The newest dump written since the last call, parsed, or `None`."""
        new = [path for path in self._files() if path not in self._seen]
        if not new:
            return None
        newest = max(new, key=_written_at)
        try:
            with open(newest, "rb") as file:
                dump = compat.parse_bfc_memory_dump(file.read())
        except (OSError, ValueError):
            dump = None
        if self._directory is None:
            self._seen.update(new)  # the user's files stay
        else:
            for path in new:
                with contextlib.suppress(OSError):
                    os.remove(path)
        return dump

    def close(self):
        """Restores `TF_BFC_MEMORY_DUMP` and removes the temporary dumps."""
        if self._directory is None:
            return
        atexit.unregister(self.close)
        if os.environ.get(MEMORY_DUMP_VARIABLE) == self.prefix:
            del os.environ[MEMORY_DUMP_VARIABLE]
        shutil.rmtree(self._directory, ignore_errors=True)
        self._directory = None


_DUMP_DIRECTORY = "keras_memguard-dump-"


def sweep_stale_dump_directories(root=None):
    """Removes dump directories whose process no longer runs.

    Args:
        root: The folder to sweep. Defaults to `None`: the system's
            temporary folder.

    Returns:
        The number of directories removed.
    """
    root = root or tempfile.gettempdir()
    removed = 0
    for path in glob.glob(os.path.join(glob.escape(root), _DUMP_DIRECTORY + "*")):
        owner = os.path.basename(path)[len(_DUMP_DIRECTORY):].split("-", 1)[0]
        if owner.isdigit():
            if _process_runs(int(owner)):
                continue
        elif _age_seconds(path) < _UNOWNED_DUMP_AGE_S:
            # No process id in the name (an older version of the package,
            # maybe still running): swept only once a day old.
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed


_UNOWNED_DUMP_AGE_S = 24 * 3600


def _age_seconds(path):
    try:
        return time.time() - os.path.getmtime(path)
    except OSError:
        return 0.0


def _process_runs(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it runs
        return True
    return True


def _written_at(path):
    # The file name ends with the allocator's clock in microseconds.
    suffix = path.rsplit(".", 1)[-1]
    return int(suffix) if suffix.isdigit() else 0


def parse_error_message(message):
    """The failed allocation and op named in an out-of-memory error's text.

    Returns:
        A dict with `shape`, `dtype`, `bytes`, `device`, `allocator` and
        `op` (each `None` when the message does not say).

    Example:

    >>> parse_error_message(
    ...     "OOM when allocating tensor with shape[2,3] and type float on "
    ...     "/device:CPU:0 by allocator cpu [[{{node m/dense/MatMul}}]]")["bytes"]
    24
    """
    found = {"shape": None, "dtype": None, "bytes": None, "device": None,
             "allocator": None, "op": None}
    match = _FAILED_ALLOCATION.search(message or "")
    if match:
        shape = tuple(int(d) for d in match.group(1).replace(" ", "").split(",") if d)
        dtype = match.group(2)
        found["shape"] = shape
        found["dtype"] = _DTYPE_NAMES.get(dtype, dtype)
        if dtype in _DTYPE_BYTES:
            found["bytes"] = math.prod(shape) * _DTYPE_BYTES[dtype]
        found["device"] = match.group(3)
        found["allocator"] = match.group(4)
    nodes = [a or b for a, b in _NODE.findall(message or "")]
    if nodes:
        found["op"] = nodes[-1]
    return found


def layer_of_op(op_name, layer_names):
    """The deepest layer named in an op's name scope, or `None`.

    Keras suffixes a layer's name scope with `_1`, `_2`, ... when a scope of
    that name exists already; both spellings are recognised.

    Example:

    >>> layer_of_op("gradient_tape/functional_1/wide_1/Relu", {"wide", "head"})
    'wide'
    """
    if not op_name:
        return None
    found = None
    for part in op_name.split("/"):
        if part in layer_names:
            found = part
            continue
        base = re.sub(r"_\d+$", "", part)
        if base in layer_names:
            found = base
    return found


def in_optimizer_update(op_name, optimizer):
    """Whether a failed op belongs to the optimizer's update of the weights.

    Keras runs the update in the optimizer's name scope (`adam/...`,
    `loss_scale_optimizer/adam/...`), after the micro-batches' passes: it
    works on whole weights and their slots, so no micro-batch count
    shrinks it. Ops of the backward pass (`gradient_tape/...`) and of a
    loop (`while/...`, the micro-batches) are not the update's.

    Example:

    >>> optimizer = keras.optimizers.Adam(name="adam")
    >>> in_optimizer_update("adam/UnsortedSegmentSum_1", optimizer)
    True
    >>> in_optimizer_update("functional/dense/MatMul", optimizer)
    False
    """
    if not op_name or optimizer is None:
        return False
    names = {getattr(optimizer, "name", None)}
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        names.add(getattr(inner, "name", None))
    names.discard(None)
    parts = op_name.split("/")[:-1]
    if not parts or parts[0].startswith("gradient") or "while" in parts:
        return False
    return any(part in names or re.sub(r"_\d+$", "", part) in names for part in parts)


def tensor_candidates(model, micro_batch_size, batch_size=None):
    """The tensors a failed micro-batch may hold, as `(bytes, layer, kind, shape)`.

    Layer outputs (at `micro_batch_size` samples, from the model's static
    shapes; a layer with another unknown dimension is left out), the model's
    inputs (the whole batch, kept for the replay, and one micro-batch),
    weights and optimizer state.
    """
    candidates = []
    layers = [layer for layer in compat.all_layers(model) if layer is not model]
    # An InputLayer's output is the input, counted below.
    inner = [layer for layer in layers if not isinstance(layer, keras.layers.InputLayer)]
    for layer in inner:
        for tensor in _outputs(layer):
            size = _bytes(tensor, micro_batch_size)
            if size:
                candidates.append((size, layer.name, "output", size[1]))
    for tensor in _model_inputs(model):
        for samples in {micro_batch_size, batch_size} - {None}:
            size = _bytes(tensor, samples)
            if size:
                candidates.append((size, "input", "input", size[1]))
    owners = {}
    for layer in layers:  # Parents come before their sublayers: deepest wins.
        for variable in layer.weights:
            owners[id(variable)] = layer.name
    for variable in model.weights:
        size = _bytes(variable, None)
        if size:
            candidates.append(
                (size, owners.get(id(variable), variable.name), "weights", size[1])
            )
    optimizer = getattr(model, "optimizer", None)
    for variable in getattr(optimizer, "variables", None) or ():
        size = _bytes(variable, None)
        if size and len(size[1]) > 0:
            name = getattr(variable, "path", None) or variable.name
            candidates.append((size, name, "optimizer state", size[1]))
    return [(size[0], name, kind, shape) for size, name, kind, shape in candidates]


def layer_output_bytes(model):
    """Bytes of one sample's layer outputs, from the model's static shapes.

    The sum over the model's layers (not its inputs) of each output's size
    at one sample: what a forward pass keeps for the backward pass, before
    anything is measured. `0` when a layer's output size is unknown (a
    subclassed model, a dimension other than the batch left open).

    Example:

    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    >>> layer_output_bytes(model)
    16
    """
    total = 0
    try:
        layers = [layer for layer in compat.all_layers(model) if layer is not model]
    except Exception:  # A model Keras cannot walk: unknown.
        return 0
    for layer in layers:
        if isinstance(layer, keras.layers.InputLayer) or compat.all_layers(layer)[1:]:
            continue
        outputs = _outputs(layer)
        if not outputs:
            return 0
        for tensor in outputs:
            size = _bytes(tensor, 1)
            if size is None:
                return 0
            total += size[0]
    return total


def _outputs(layer):
    try:
        output = layer.output
    except (AttributeError, ValueError, RuntimeError):
        return []
    outputs = output if isinstance(output, (list, tuple)) else [output]
    return [tensor for tensor in outputs if hasattr(tensor, "shape")]


def _model_inputs(model):
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return []
    return [tensor for tensor in inputs or [] if hasattr(tensor, "shape")]


def _bytes(tensor, batch):
    """`(bytes, shape)` of `tensor` at `batch` samples.

    `batch`: the samples of a tensor whose first dimension is the batch's
    (a layer's output, a model's input), taken as that dimension even where
    it is known: a model that Keras built from the first batch (a
    `Sequential` without an `Input`) has that batch's size there. `None`
    for a tensor without one (a weight): its shape as it is, and `None`
    back where a dimension is unknown.
    """
    try:
        shape = list(tensor.shape)
        dtype = str(getattr(tensor.dtype, "name", tensor.dtype))
    except (AttributeError, TypeError, ValueError):
        return None
    if dtype not in _DTYPE_BYTES:
        return None
    if shape and batch is not None:
        shape[0] = batch
    if any(d is None for d in shape):
        return None
    shape = tuple(int(d) for d in shape)
    return math.prod(shape) * _DTYPE_BYTES[dtype], shape


def _label(requested, candidates):
    matches = [c for c in candidates if c[0] == requested]
    if not matches:
        return TensorEntry(int(requested), (), None, None)
    # Activations first: at an out-of-memory error they are what grows.
    order = ("output", "input", "weights", "optimizer state")
    kind = min((c[2] for c in matches), key=order.index)
    chosen = [c for c in matches if c[2] == kind]
    layers = tuple(dict.fromkeys(c[1] for c in chosen))
    return TensorEntry(int(requested), layers, kind, chosen[0][3])


def explain(
    error_message,
    dump,
    model,
    step,
    batch_size,
    micro_batches,
    replayed_with=None,
    limit_bytes=None,
):
    """Builds an `OutOfMemoryExplanation`.

    Args:
        error_message: The `ResourceExhaustedError`'s text.
        dump: The allocator's `MemoryDump` at the failure, or `None`.
        model: The Keras model being trained.
        step: The global batch counter.
        batch_size: Samples of the batch (each replica's part), or `None`.
        micro_batches: The micro-batch count that failed.
        replayed_with: The count the batch is replayed with, or `None`.
        limit_bytes: The device's memory limit, or `None`.

    Returns:
        An `OutOfMemoryExplanation`.
    """
    failed = parse_error_message(error_message)
    micro_batch_size = -(-batch_size // micro_batches) if batch_size else None
    try:
        candidates = tensor_candidates(model, micro_batch_size, batch_size)
        # Every layer, also those without static shapes (subclassed models).
        layer_names = {layer.name for layer in compat.all_layers(model)}
    except Exception:  # Explaining must never stop the replay.
        candidates, layer_names = [], set()
    failed_layer = layer_of_op(failed["op"], layer_names)
    in_use = largest_free = fragmentation = None
    tensors = ()
    if dump is not None:
        in_use = int(dump.stats.bytes_in_use)
        limit_bytes = limit_bytes or None
        held = sum(chunk.size for chunk in dump.chunk)
        free_chunks = [chunk.size for chunk in dump.chunk if not chunk.in_use]
        largest_free = max(free_chunks, default=0)
        free = sum(free_chunks)
        if limit_bytes:
            unheld = max(0, limit_bytes - held)
            largest_free = max(largest_free, unheld)
            free += unheld
        fragmentation = 1.0 - largest_free / free if free else 0.0
        live = sorted(
            (chunk.requested_size for chunk in dump.chunk if chunk.in_use),
            reverse=True,
        )
        tensors = tuple(_label(size, candidates) for size in live[:_LARGEST_TENSORS])
    return OutOfMemoryExplanation(
        step=int(step),
        batch_size=batch_size,
        micro_batches=int(micro_batches),
        micro_batch_size=micro_batch_size,
        replayed_with=replayed_with,
        failed_allocation_bytes=failed["bytes"],
        failed_shape=failed["shape"],
        failed_dtype=failed["dtype"],
        failed_op=failed["op"],
        failed_layer=failed_layer,
        backward=(
            None if failed["op"] is None else failed["op"].startswith("gradient")
        ),
        device=failed["device"],
        limit_bytes=limit_bytes,
        in_use_bytes=in_use,
        largest_free_chunk_bytes=largest_free,
        fragmentation=fragmentation,
        largest_tensors=tensors,
        source="bfc_memory_dump" if dump is not None else "error_message",
    )


def _mib(value):
    return "?" if value is None else f"{value / _MIB:.0f} MiB"


def describe(explanation):
    """One line saying why the batch ran out of memory.

    Example: `out of memory at step 3 (micro-batch 256 of a batch of 256):
    layer 'small_b' (backward pass) asked for 384 MiB [256,64,64,96]
    float32 with 464 MiB of 600 MiB in use and 64 MiB the largest free
    block (fragmentation 0.56); largest live tensor 384 MiB, output of
    'wide'`.
    """
    e = explanation
    where = f"layer '{e.failed_layer}'" if e.failed_layer else (
        f"op '{e.failed_op}'" if e.failed_op else "an allocation"
    )
    if e.backward:
        where += " (backward pass)"
    shape = (
        f" [{','.join(str(d) for d in e.failed_shape)}] {e.failed_dtype}"
        if e.failed_shape is not None
        else ""
    )
    text = (
        f"out of memory at step {e.step} (micro-batch {e.micro_batch_size} of a "
        f"batch of {e.batch_size}): {where} asked for {_mib(e.failed_allocation_bytes)}{shape}"
    )
    if e.in_use_bytes is not None:
        text += f" with {_mib(e.in_use_bytes)} of {_mib(e.limit_bytes)} in use"
        text += f" and {_mib(e.largest_free_chunk_bytes)} the largest free block"
        text += f" (fragmentation {e.fragmentation:.2f})"
    if e.largest_tensors:
        top = e.largest_tensors[0]
        text += f"; largest live tensor {_mib(top.bytes)}"
        if top.layers:
            names = " or ".join(f"'{n}'" for n in top.layers[:3])
            if len(top.layers) > 3:
                names += f" ({len(top.layers) - 3} more layers of that size)"
            text += f", {top.kind} of {names}"
    return text


def to_dict(explanation, description=None):
    """A JSON-safe dict of `explanation` (what `oom-<step>.json` holds)."""
    data = explanation._asdict()
    data["failed_shape"] = (
        list(explanation.failed_shape) if explanation.failed_shape else None
    )
    data["largest_tensors"] = [
        {
            "bytes": t.bytes,
            "layer": " or ".join(t.layers) or None,
            "kind": t.kind,
            "shape": list(t.shape) if t.shape is not None else None,
        }
        for t in explanation.largest_tensors
    ]
    data["explanation"] = description or describe(explanation)
    return data


def write(explanation, directory, description=None):
    """Writes `<directory>/oom-<step>.json`; returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"oom-{explanation.step}.json")
    attempt = 1
    while os.path.exists(path):  # The replay of the same batch failed too.
        attempt += 1
        path = os.path.join(directory, f"oom-{explanation.step}-{attempt}.json")
    partial = path + ".partial"
    with open(partial, "w", encoding="utf-8") as file:
        json.dump(to_dict(explanation, description), file, indent=1)
    os.replace(partial, path)
    return path
