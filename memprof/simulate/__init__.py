"""The second producer of Traces: the same step on shape-only tensors (:mod:`.estimate`, :mod:`.generation`),
the rules a target applies above the ops (:mod:`.kernels`, :mod:`.cpu_kernels`, :mod:`.autocast`,
:mod:`.modes`), one rank of a parallel job (:mod:`.ranks`) and the batch-size planner (:mod:`.planner`).
Its results are plain data: :mod:`memprof.report` adds their text and views."""
