import pytest

from adaptive_batch.core.schedule import (
    ConstantSchedule,
    PhaseSchedule,
    Progress,
    as_schedule,
    check_effective_batch_size,
)


def at(step=0, samples=0, fraction=0.0):
    return Progress(step=step, samples_seen=samples, fraction=fraction)


def test_phase_schedule_by_fraction_switches_at_each_boundary():
    schedule = PhaseSchedule([8, 16, 32], boundaries=[0.1, 0.3])
    assert [schedule(at(fraction=f)) for f in (0.0, 0.0999, 0.1, 0.2999, 0.3, 0.99)] == [8, 8, 16, 16, 32, 32]


def test_phase_schedule_by_samples_and_by_steps():
    by_samples = PhaseSchedule([8, 12], boundaries=[100], unit="samples")
    assert [by_samples(at(samples=s)) for s in (0, 99, 100, 5000)] == [8, 8, 12, 12]
    by_steps = PhaseSchedule([4, 8, 16], boundaries=[10, 20], unit="steps")
    assert [by_steps(at(step=k)) for k in (0, 9, 10, 19, 20)] == [4, 4, 8, 8, 16]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sizes": [8, 16], "boundaries": []}, "one boundary fewer than sizes"),
        ({"sizes": [8, 16], "boundaries": [0.5], "unit": "epochs"}, "unit='epochs' is not one of"),
        ({"sizes": [8, 16, 32], "boundaries": [0.5, 0.2]}, "strictly increasing"),
        ({"sizes": [8, 16], "boundaries": [1.5]}, "strictly between 0 and 1"),
        (
            {"sizes": [8, 16], "boundaries": [-3], "unit": "steps"},
            "-3 with unit='steps' must be a positive integer",
        ),
        # a step or a sample count is whole: 0.5 steps would silently mean "from step 1"
        (
            {"sizes": [8, 16], "boundaries": [0.5], "unit": "steps"},
            r"boundary 0.5 with unit='steps' must be a positive integer \(optimizer steps taken\); use e.g. 1, or "
            "unit='fraction'",
        ),
        (
            {"sizes": [8, 16], "boundaries": [99.5], "unit": "samples"},
            "99.5 with unit='samples' must be a positive",
        ),
        # one number where a list is due: not "'float' object is not iterable" from inside the class
        (
            {"sizes": [8, 16], "boundaries": 0.5},
            r"boundaries=0.5 is not a list; .* e.g. boundaries=\[0.5\]",
        ),
        ({"sizes": 8, "boundaries": []}, r"sizes=8 is not a list; .* e.g. sizes=\[8\]"),
        ({"sizes": [8, 16], "boundaries": "0.5"}, r"boundaries='0.5' is not a list"),
        ({"sizes": [8, 0], "boundaries": [0.5]}, "effective batch 0"),
        ({"sizes": [8, 12.5], "boundaries": [0.5]}, "effective batch 12.5"),
        ({"sizes": [], "boundaries": []}, "at least one size"),
    ],
)
def test_phase_schedule_rejects_bad_input_with_the_value_and_a_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PhaseSchedule(**kwargs)


def test_phase_schedule_positionally_given_one_boundary_names_the_fix():
    with pytest.raises(ValueError, match=r"boundaries=0.5 is not a list") as error:
        PhaseSchedule([8, 16], 0.5)
    assert "PhaseSchedule([8, 16], boundaries=[0.5])" in str(error.value)


def test_phase_schedule_without_boundaries_names_them_rather_than_a_missing_argument():
    with pytest.raises(ValueError) as error:
        PhaseSchedule([8, 16])
    assert str(error.value) == (
        "PhaseSchedule has 2 sizes and 0 boundaries; it needs one boundary fewer than sizes (each boundary starts "
        "the next phase), e.g. PhaseSchedule([8, 16], boundaries=[0.5]) for phases of equal shares of the budget."
    )
    assert PhaseSchedule([8]).describe() == "8 (constant)"


def test_whole_step_and_sample_boundaries_are_kept_as_ints():
    schedule = PhaseSchedule([4, 8], boundaries=[10.0], unit="steps")
    assert schedule.boundaries == (10,) and isinstance(schedule.boundaries[0], int)
    assert [schedule(at(step=k)) for k in (9, 10)] == [4, 8]
    assert [schedule.phase(at(step=k)) for k in (9, 10)] == [0, 1]


def test_as_schedule_accepts_ints_and_callables_only():
    assert as_schedule(24)(at()) == 24
    assert isinstance(as_schedule(24), ConstantSchedule)
    custom = lambda progress: 8 if progress.step < 3 else 16  # noqa: E731
    assert as_schedule(custom) is custom
    with pytest.raises(ValueError, match="bool"):
        as_schedule(True)
    with pytest.raises(ValueError, match="neither an int nor a callable"):
        as_schedule("32")
    with pytest.raises(ValueError, match="effective batch -4"):
        as_schedule(-4)


@pytest.mark.parametrize("value", [0, -1, 2.5, float("nan"), float("inf"), None, "8", True])
def test_check_effective_batch_size_rejects_non_positive_integers(value):
    with pytest.raises(ValueError, match="positive integer"):
        check_effective_batch_size(value, where="test")


def test_check_effective_batch_size_accepts_integral_floats():
    assert check_effective_batch_size(16.0, where="test") == 16
    assert isinstance(check_effective_batch_size(16.0, where="test"), int)
