"""Group, read and fold every node's journal, in parallel processes when it pays."""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TextIO

from daemon.postmortem.fold import KeepDetails, NodeFold, fold_node, no_request
from daemon.postmortem.progress import (
    ProgressBar,
    ProgressSlot,
    drawing,
    init_worker,
    on_terminal,
    worker_context,
)
from daemon.postmortem.sources import NodeSource, group_sources
from daemon.postmortem.vocab import PostmortemError

# Parallel folding pays for its process start-up above about this much input.
PARALLEL_MIN_BYTES: Final = 8 * 1024 * 1024


def load(
    paths: Sequence[Path],
    *,
    jobs: int | None = None,
    progress: TextIO | None = None,
    details: KeepDetails | None = None,
) -> list[NodeFold]:
    """Group, read and fold the journals; one :class:`NodeFold` per node, in input order.

    ``jobs``: processes folding nodes at once, this one included (None: one
    per node up to the CPUs, when the input is large enough to pay for
    them). ``progress``: a stream for a progress bar, drawn only if it is a
    on_terminal. ``details``: which requests' records to keep for timelines
    (None: all); what the analysis needs of the others is kept regardless.
    """
    sources = group_sources(paths)
    if not sources:
        raise PostmortemError("no journals given")
    if jobs is None:
        big = sum(s.nbytes for s in sources) >= PARALLEL_MIN_BYTES
        jobs = min(len(sources), os.cpu_count() or 1) if big else 1
    stream = on_terminal(progress)
    bar = ProgressBar(len(sources), stream) if stream is not None else None
    tasks = [
        _FoldTask(s, bar.slot(i) if bar is not None else None, details)
        for i, s in enumerate(sources)
    ]
    if jobs <= 1 or len(tasks) == 1:
        with drawing(bar):
            return [task.run() for task in tasks]
    return _load_parallel(tasks, jobs, bar)


@dataclass(frozen=True, slots=True)
class _FoldTask:
    """One node to fold, picklable into a worker process."""

    source: NodeSource
    progress: ProgressSlot | None
    details: KeepDetails | None

    def run(self) -> NodeFold:
        fold = fold_node(self.source, self.progress, self.details)
        if self.details is not None and self.details is not no_request:
            fold.keep_details(self.details)
        return fold

    def run_in_worker(self) -> NodeFold:
        return self.run().pack()


def _load_parallel(tasks: list[_FoldTask], jobs: int, bar: ProgressBar | None) -> list[NodeFold]:
    """The largest journal folds here, the others in workers meanwhile.

    Folding one node in this process instead of waiting saves a process and,
    above all, shipping the largest result back (pickling costs about a
    tenth of the fold).
    """
    largest = max(range(len(tasks)), key=lambda i: tasks[i].source.nbytes)
    others = [i for i in range(len(tasks)) if i != largest]
    context = worker_context()
    shared = bar.shared if bar is not None else None
    results: dict[int, NodeFold] = {}
    with ProcessPoolExecutor(
        max_workers=max(1, min(jobs - 1, len(others))),
        mp_context=context,
        initializer=init_worker,
        initargs=(shared,),
    ) as pool:
        futures = {i: pool.submit(_FoldTask.run_in_worker, tasks[i]) for i in others}
        with drawing(bar):
            results[largest] = tasks[largest].run()
            results.update((i, future.result()) for i, future in futures.items())
    return [results[i] for i in range(len(tasks))]
