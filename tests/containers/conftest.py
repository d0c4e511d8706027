"""Real containers: the image ``tools/build-image`` builds (once per run of the suite), and a
cluster of podman containers started the way ``deploy/operator/job.yaml`` starts its pods
(``tools/pods.py``: :class:`PodCluster`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from pods import ImageError, PodCluster, build_image


@pytest.fixture(scope="session")
def podman_image() -> dict:
    """The image (``tools/pods.build_image``): ``{"image": tag, "env": environment for
    podman}``. No podman here, or no image: the test fails with the one line the script gave."""
    try:
        built = build_image()
    except ImageError as exc:
        pytest.fail(str(exc), pytrace=False)
    print(built["log"])  # the build's time and the image's size, shown with -s
    return built


@pytest.fixture(scope="module")
def pod_cluster_factory(podman_image, tmp_path_factory):
    """``make(data, checkpoint_on_scheduler=True) -> PodCluster`` (not yet started); every
    cluster made is removed at the end."""
    made: list[PodCluster] = []
    tmp_path = tmp_path_factory.mktemp("pods")

    def make(data: Path, *, checkpoint_on_scheduler: bool = True) -> PodCluster:
        ckpt = tmp_path / f"ckpt-{len(made)}"
        ckpt.mkdir()
        ckpt.chmod(0o777)  # the image runs as uid 1000
        c = PodCluster(
            podman_image["image"],
            podman_image["env"],
            data,
            ckpt,
            checkpoint_on_scheduler=checkpoint_on_scheduler,
        )
        made.append(c)
        return c

    yield make
    for i, c in enumerate(made):
        c.save_logs(tmp_path / f"logs-{i}")  # for whoever reads a failure
        c.close()
