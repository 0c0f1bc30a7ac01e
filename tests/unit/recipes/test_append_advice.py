"""Hydra's "To append to your config use +key=..." is kept only when that ``+`` override then
passes the checks; otherwise the error line says why it would be refused and the closest key."""

import pytest

from recipes.compose import compose


def error_of(overrides, capsys) -> str:
    with pytest.raises(SystemExit):
        compose(overrides)
    return capsys.readouterr().err.strip()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["train.max_stpes=5"], "train.max_stpes is not a known key"),
        (["optim.momentum=0.9"], "optim.momentum is not an option of torch.optim.AdamW"),
        (["model.config.hiden_size=3"], "did you mean model.config.hidden_size?"),
        (["trian.max_steps=3"], "trian is not a known key: remove it"),  # a misspelt section
    ],
)
def test_advice_that_would_fail_is_not_given(overrides, expected, capsys):
    line = error_of(overrides, capsys)
    assert line.startswith(f"error: Could not override '{overrides[0].split('=')[0]}'"), line
    assert "To append" not in line and expected in line, line
    assert len(line.splitlines()) == 1


def test_a_misspelt_key_gets_the_key_it_resembles(capsys):
    line = error_of(["train.seq_lne=4"], capsys)
    assert line.endswith("did you mean train.seq_len?"), line
    line = error_of(["trian.max_steps=3"], capsys)
    assert line.endswith("did you mean train.max_steps?"), line


def test_advice_that_works_is_kept(capsys):
    line = error_of(["optim._target_=torch.optim.SGD", "optim.momentum=0.9"], capsys)
    assert "To append to your config use +optim.momentum=0.9" in line, line
    config = compose(["optim._target_=torch.optim.SGD", "+optim.momentum=0.9"])
    assert config.optim.momentum == 0.9
