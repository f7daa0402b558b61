"""The documentation's PyTorch blocks (`<!-- docs-test: backend=torch -->`) run.

Collected by `tests/docs_blocks.py`; each runs in this process (Keras on
torch), in an empty folder, as a script would.
"""

import gc

import keras
import pytest

import docs_blocks

BLOCKS = [
    block for block in docs_blocks.all_blocks()
    if block.backend == "torch" and not block.excerpt
]


@pytest.mark.skipif(not BLOCKS, reason="no torch block in the documentation")
@pytest.mark.parametrize("block", BLOCKS or [None], ids=lambda block: getattr(block, "name", "none"))
def test_docs_block_runs(block, tmp_path, monkeypatch, request):
    request.node.user_properties.append(("docs_blocks", block.covers))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    namespace = {"__name__": "__main__", "__file__": block.path}
    try:
        exec(compile(block.code, block.name, "exec"), namespace)
    finally:
        namespace.clear()
        keras.backend.clear_session()
        gc.collect()
