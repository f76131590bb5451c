"""The README's usage examples run as written (on CPU: the torch and xla backends)."""
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_example_runs(i):
    exec(compile(BLOCKS[i], f"README.md[python block {i}]", "exec"), {})
