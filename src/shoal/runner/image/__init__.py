"""The image runner: a diffusers pipeline in its own supervised subprocess.

The node side is the ordinary RunnerSupervisor started with image_runner_options (its
command runs entrypoint.py here); the wire is the ordinary runner protocol plus
SubmitImages (messages.py). The subprocess loads the pipeline, then draws one request at a
time (loop.py), streaming a progress chunk per denoising step, each image, then ImagesDone.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

from shoal.runner.options import SupervisorOptions

BACKEND = "diffusers"  # the image backend's name
IMAGE_RUNNER_COMMAND = (sys.executable, "-m", "shoal.runner.image.entrypoint")
INSTALL_HINT = "pip install 'shoal[image]'"


def diffusers_installed() -> bool:
    """Whether this Python can run the image backend (the optional extra 'image')."""
    return importlib.util.find_spec("diffusers") is not None


def image_runner_options(options: SupervisorOptions) -> SupervisorOptions:
    """options for a runner of an image model: the image runner's command, same bounds."""
    return dataclasses.replace(options, runner_command=IMAGE_RUNNER_COMMAND)
