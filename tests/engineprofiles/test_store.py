"""Finding profiles: by path or shipped name; anything else is a typed error."""

import os

import pytest

from engineprofiles.errors import EngineProfilesError, ProfileError, ProfileNotFound
from engineprofiles.regions import REGIONS
from engineprofiles.store import get_profile, resolve


@pytest.mark.parametrize("bad", [None, 5, 1.5, b"name", ["a"], REGIONS["rope"].all_points()[0]],
                         ids=["None", "int", "float", "bytes", "list", "Point"])
def test_get_profile_of_something_that_is_not_a_profile_path_or_name_is_a_typed_error(bad):
    with pytest.raises(ProfileError, match="a Profile, a path or a shipped name") as e:
        get_profile(bad)
    assert isinstance(e.value, EngineProfilesError)


def test_a_fifo_is_not_resolved_as_a_profile_file(tmp_path):
    fifo = tmp_path / "p.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ProfileNotFound):
        resolve(fifo)


def test_a_folder_is_not_resolved_as_a_profile_file(tmp_path):
    with pytest.raises(ProfileNotFound):
        resolve(tmp_path)
