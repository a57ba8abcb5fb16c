"""Imported by every worker process of a preloading local Ray as it starts (rayflow.distributed.worker_imports says
why): the actor modules and the run's pipeline class, unless the worker was started for an actor that needs none of
them."""

import importlib
import logging
import os

from rayflow.distributed.worker_imports import ACTOR_MODULES, PIPELINE_ENV, SKIP_ENV


def preload() -> None:
    for name in ACTOR_MODULES:
        importlib.import_module(name)
    pipeline = os.environ.get(PIPELINE_ENV)
    if pipeline:
        import diffusers

        # diffusers' lazy module imports the class's module and the model classes and transformers code it uses.
        getattr(diffusers, pipeline, None)


if os.environ.get(SKIP_ENV) != "1":
    try:
        preload()
    except Exception:
        # Only time is at stake here: the actor that takes this worker imports what it needs and reports what fails.
        logging.getLogger("rayflow").exception("preloading the actor modules failed")
