"""Evaluation tasks: the :class:`Task` interface and the built-ins, POPE (per split), CHAIR and POPE over
the video world's clips (``video_pope``), one module each.

A task turns the recipe and the data into :class:`Sample` items (one prompt about one image or one video, with
a stable ``doc_id``), and turns the finished per-sample records back into metrics. Tasks register in
:data:`mmfast.registry.TASKS` (``eval.tasks`` names them); a new benchmark is one module::

    @TASKS.register("name", description="one line for `mmfast list`")
    class Name(Task):
        Config = NameConfig                    # optional options dataclass: recipe section eval.name
        needs = frozenset({"images"})          # shared inputs data.py locates (images, annotations)
        def samples(self, limit): ...          # -> list[Sample]
        def metrics(self, records): ...        # {record group: [record, ...]} -> {metric: value}

Every module of this package is imported (so registered) with it; outside packages make their
module known through the ``mmfast.plugins`` entry point group.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import Sample, Task, build_tasks

for _m in pkgutil.iter_modules(__path__):
    if not _m.name.startswith("_") and _m.name != "base":
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["Sample", "Task", "build_tasks"]
