"""The public API is small, sorted, documented and shown in the README."""

import inspect
import pathlib
import re

import keras_memguard

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_all_is_sorted_and_complete():
    assert keras_memguard.__all__ == sorted(keras_memguard.__all__)
    for name in keras_memguard.__all__:
        assert hasattr(keras_memguard, name), name


def test_every_public_name_is_documented():
    for name in keras_memguard.__all__:
        obj = getattr(keras_memguard, name)
        doc = inspect.getdoc(obj)
        assert doc and len(doc.splitlines()[0]) > 10, name


def test_readme_shows_every_public_name_in_use():
    text = README.read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", text, flags=re.S))
    for name in keras_memguard.__all__:
        if name.endswith("Error"):
            # Errors are listed in the README's table of errors.
            assert f"`{name}`" in text, name
        else:
            assert re.search(rf"\b{name}\b", code), name
