"""How many steps a run may skip as non-finite (train.on_nonfinite=skip) before it fails."""

from components.runtime.exit_status import skipped_verdict


def test_no_skipped_step_says_nothing():
    assert skipped_verdict(0, 10) == (False, None)


def test_a_few_skipped_steps_are_a_warning():
    fails, line = skipped_verdict(1, 10)
    assert not fails and line.startswith("warning: 1 of 10 steps was skipped as non-finite")
    assert line.endswith("its update was not applied")
    assert skipped_verdict(2, 10)[1].endswith("their updates were not applied")


def test_more_than_half_skipped_fails_the_run():
    assert skipped_verdict(5, 10)[0] is False
    fails, line = skipped_verdict(9, 10)
    assert fails and line.startswith("9 of 10 steps were skipped as non-finite")
    assert "hf/ was not exported" in line
