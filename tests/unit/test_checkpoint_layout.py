"""megatron.training's save-root layout (checkpoint_layout.py), as Megatron names it."""

from __future__ import annotations

import pytest

from megatron_latentmoe.checkpoint_layout import (
    TRACKER_FILE,
    iteration_dir_name,
    iteration_of_dir_name,
    tracked_checkpoint_dir,
    tracker_text,
)


def test_iteration_directories_are_named_as_megatron_names_them():
    assert TRACKER_FILE == "latest_checkpointed_iteration.txt"
    assert iteration_dir_name(100) == "iter_0000100"
    assert iteration_dir_name(None) == "release"
    assert (tracker_text(100), tracker_text(None)) == ("100", "release")


@pytest.mark.parametrize("iteration", [0, 5, 100, 9_999_999, 12_345_678])
def test_a_directory_name_gives_back_its_iteration(iteration):
    assert iteration_of_dir_name(iteration_dir_name(iteration)) == iteration


@pytest.mark.parametrize(
    "name", ["release", "iter_5", "iter_00000005", "iter_0000005.tmp", "iter_", "xiter_0000005"]
)
def test_other_names_are_no_iteration(name):
    assert iteration_of_dir_name(name) is None


def test_the_tracker_names_the_checkpoint_directory(tmp_path):
    assert tracked_checkpoint_dir(tmp_path) is None
    tracker = tmp_path / TRACKER_FILE
    tracker.write_text("release\n")
    assert tracked_checkpoint_dir(tmp_path) == tmp_path / "release"
    tracker.write_text("20")
    assert tracked_checkpoint_dir(tmp_path) == tmp_path / "iter_0000020"


@pytest.mark.parametrize("iteration", [None, 0, 100])
def test_the_tracker_written_for_an_iteration_names_its_directory(tmp_path, iteration):
    """What the importer writes (``--iteration 0`` included: not the release) reads back as the
    directory it wrote."""
    (tmp_path / TRACKER_FILE).write_text(tracker_text(iteration))
    assert tracked_checkpoint_dir(tmp_path) == tmp_path / iteration_dir_name(iteration)
    assert (tracker_text(0), iteration_dir_name(0)) == ("0", "iter_0000000")


def test_a_tracker_holding_something_else_raises_the_given_error(tmp_path):
    class MyError(ValueError):
        pass

    (tmp_path / TRACKER_FILE).write_text("2O")
    with pytest.raises(
        MyError, match=r"latest_checkpointed_iteration.txt' holds '2O': expected an iteration"
    ):
        tracked_checkpoint_dir(tmp_path, MyError)


@pytest.mark.parametrize("text, held", [(" 2O\n", "'2O'"), ("2²", "'2²'")])
def test_a_tracker_holding_something_else_is_refused_with_the_exact_text(tmp_path, text, held):
    """'2²' is digits to str.isdigit but no int: it was int()'s ValueError, not the given error."""

    class MyError(Exception):
        pass

    tracker = tmp_path / TRACKER_FILE
    tracker.write_text(text)
    with pytest.raises(MyError) as err:
        tracked_checkpoint_dir(tmp_path, MyError)
    assert str(err.value) == (
        f"checkpoint tracker {str(tracker)!r} holds {held}: expected an iteration number or "
        "'release'"
    )


def test_a_tracker_that_is_not_text_is_refused_naming_the_file(tmp_path):
    """A corrupted (not UTF-8) tracker: the given error naming the file, not a traceback."""
    tracker = tmp_path / TRACKER_FILE
    tracker.write_bytes(b"\xff20")

    class MyError(Exception):
        pass

    with pytest.raises(MyError) as err:
        tracked_checkpoint_dir(tmp_path, MyError)
    assert str(err.value) == (
        f"checkpoint tracker {str(tracker)!r} cannot be read: 'utf-8' codec can't decode byte "
        "0xff in position 0: invalid start byte"
    )
