"""Importing the recipe prints nothing: transformers imports torchao wherever it is installed, and
that import logs torchao's "Failed to load .../torchao/_C*.so" (CUDA kernels, absent on a CPU
build) and torch's "<enum ...> is an Enum subclass" for torchao's pytree constants. ``components``
drops exactly those lines (``components/__init__.py``), at their loggers; anything else shows. A
whole run's stderr is empty (tests/e2e/test_recipe_training.py), the fp8 run's has neither line
(tests/e2e/test_fp8.py)."""

import enum
import logging

import components  # noqa: F401 - the filters, as any import of the recipe installs them


class Elsewhere(enum.Enum):  # an Enum of another package than torchao's
    A = 1


class Torchaos(enum.Enum):  # as torchao.float8's KernelPreference
    A = 1


Torchaos.__module__ = "torchao.float8.config"


def test_only_torchao_s_import_lines_are_dropped(caplog):
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    natively = "%s is an Enum subclass and is now natively supported by torch.compile"
    with caplog.at_level(logging.WARNING):
        torchao.warning("Failed to load /site-packages/torchao/_C_mxfp8.so: Could not load")
        torchao.warning("Failed to load the user's config")  # another failure: shown
        torchao.warning("some other torchao warning")
        pytree.warning(natively, Torchaos)
        pytree.warning(natively, Elsewhere)
    assert [record.getMessage() for record in caplog.records] == [
        "Failed to load the user's config",
        "some other torchao warning",
        natively % Elsewhere,
    ]
