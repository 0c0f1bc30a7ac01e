"""Which cases of a module's parametrized tests this session runs, for module fixtures that run a
sweep once for all of them.

A parity matrix keeps its representative cases in ``make test`` and marks the rest ``sweep``
(opt-in: ``pytest -m sweep``). A module fixture that runs every case's recipe runs up front asks
:func:`selected_params` which cases survived ``-m``/``-k`` deselection and runs only those.
"""

import pytest


def selected_params(request: pytest.FixtureRequest, name: str) -> list:
    """The values of parameter ``name`` among this session's selected tests of the requesting
    module, in collection order without repeats (deselected items are no longer in
    ``session.items``)."""
    values = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if item.module is not request.module or callspec is None or name not in callspec.params:
            continue
        if callspec.params[name] not in values:
            values.append(callspec.params[name])
    return values
