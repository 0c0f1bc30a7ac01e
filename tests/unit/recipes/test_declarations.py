"""Each key is declared once: the schema holds the types, choices and meanings, its hints are made
from the same lists the components dispatch on, and the YAML files hold values only."""

import re
from pathlib import Path
from typing import get_args

import pytest

from components.checkpoint.export import EXPORT_DTYPES
from components.debug.faults import KINDS, parse_fault
from components.models import activation_checkpointing, precision
from recipes.schema import Checkpoint, Train

CONF = Path(__file__).resolve().parents[3] / "conf"


def test_the_schema_offers_what_the_components_take():
    train = Train.model_fields
    assert get_args(train["precision"].annotation) == precision.PRECISIONS
    modes = get_args(train["activation_checkpointing"].annotation)
    assert modes == activation_checkpointing.ACTIVATION_CHECKPOINTING
    assert "selective" in train["activation_checkpointing"].description
    dtypes = get_args(get_args(Checkpoint.model_fields["export_dtype"].annotation)[0])
    assert dtypes == tuple(EXPORT_DTYPES)


def test_a_wrong_fault_names_every_kind_the_faults_take():
    with pytest.raises(ValueError) as refused:
        parse_fault("nan_gard@3")
    assert all(kind in str(refused.value) for kind in KINDS), str(refused.value)


def test_the_defaults_file_holds_values_not_lists_of_choices():
    text = (CONF / "config.yaml").read_text().split("\nhydra:")[0]
    comments = [line for line in text.splitlines() if "#" in line and "defaults" not in line]
    keyed = [line for line in comments if re.match(r"^\s*\w+:", line)]
    assert not keyed, keyed  # a key's meaning is its schema field's comment
