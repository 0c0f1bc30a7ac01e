"""Which cases of a module's parametrized tests this session runs, for module fixtures that run a
sweep once for all of them.

A parity matrix keeps its representative cases in ``make test`` and marks the rest ``sweep``
(opt-in: ``pytest -m sweep``). A module fixture that runs every case's recipe runs up front asks
:func:`selected_params` which cases survived ``-m``/``-k`` deselection and runs only those.
"""

import pytest


def _selected_items(request: pytest.FixtureRequest) -> list[pytest.Item]:
    """This session's selected tests of the requesting module."""
    return [item for item in request.session.items if item.module is request.module]


def is_selected(request: pytest.FixtureRequest, test) -> bool:
    """Whether test function ``test`` of the requesting module survived deselection (any of its
    cases, if it is parametrized: ``originalname`` is the name without the case's id)."""
    return any(item.originalname == test.__name__ for item in _selected_items(request))


def selected_params(request: pytest.FixtureRequest, name: str) -> list:
    """The values of parameter ``name`` among this session's selected tests of the requesting
    module, in collection order without repeats (deselected items are no longer in
    ``session.items``)."""
    values = []
    for item in _selected_items(request):
        callspec = getattr(item, "callspec", None)
        if callspec is None or name not in callspec.params:
            continue
        if callspec.params[name] not in values:
            values.append(callspec.params[name])
    return values
