import pytest

from engineprofiles.regions import REGIONS
from engineprofiles.schema import make_profile


def synthetic_profile(points=None, **engine):
    points = points or {n: s.all_points()[-1] for n, s in REGIONS.items()}
    eng = dict(name="synthetic", version="0.0", backend="cpu", device="test-cpu", torch_version="2.13.0",
               execution_mode="eager")
    eng.update(engine)
    return make_profile(
        engine=eng,
        dtype="bfloat16",
        points=points,
        evidence={n: {"match_rate": 1.0, "elements": 100, "shapes": ["tokens=1"], "path": "reference"} for n in REGIONS},
        provenance=dict(date="2026-12-02T00:00:00Z", probe_version="1", package_version="0.1.0", method="synthetic",
                        command="pytest"),
    )


@pytest.fixture
def profile():
    return synthetic_profile()


@pytest.fixture
def profile_file(tmp_path, profile):
    path = tmp_path / "good.yaml"
    profile.save(path)
    return path
