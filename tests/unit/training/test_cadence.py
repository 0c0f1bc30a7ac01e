"""The step cadence (components/training/cadence.py): what the loop does after each step."""

from components.training.cadence import Cadence


def cadence(**given) -> Cadence:
    settings = dict(max_steps=10, last_step=10, validate_every=4, save_every=3)
    return Cadence(**(settings | dict(check_replicas_every=5) | given))


def test_validation_every_n_steps_and_after_the_last():
    assert [done for done in range(1, 11) if cadence().validate(done)] == [4, 8, 10]
    assert not any(cadence(validate_every=0).validate(done) for done in range(1, 11))


def test_saves_and_replica_checks_every_n_steps_zero_for_never():
    assert [done for done in range(1, 11) if cadence().save(done)] == [3, 6, 9, 10]  # the last
    assert [done for done in range(1, 11) if cadence().check_replicas(done)] == [5, 10]
    assert not any(cadence(save_every=0).save(done) for done in range(1, 11))
    assert not any(cadence(check_replicas_every=0).check_replicas(done) for done in range(1, 11))


def test_a_launch_runs_from_its_resumed_step_to_its_last():
    assert cadence().steps(0) == range(0, 10)
    assert cadence(last_step=6).steps(4) == range(4, 6)  # train.stop_after=6, resumed at 4
    assert cadence().steps(10) == range(10, 10)  # a finished run: nothing


def test_a_launch_that_stops_before_the_end_saves_its_last_step():
    stop_after = cadence(last_step=6)
    assert stop_after.save_at_stop(first=0, done=6)
    assert not cadence().save_at_stop(first=0, done=10)  # the run's end: the export follows
    assert not stop_after.save_at_stop(first=6, done=6)  # nothing ran in this launch
    assert cadence(save_every=0).save_at_stop(first=6, done=10)  # resumed to the end: complete
