"""The benchmark tool, kept apart from the training runtime: ``python -m bagua_lite.bench --config ...``.

``config``   the YAML matrix, validated before any process starts
``cells``    one cell's model: ours, a DDP baseline or torchft's DiLoCo (optional)
``runner``   launches the ranks (one network namespace each on emulated links), times the cells, shows
             progress (cell i/N, time left)
``timing``   one cell's seconds per step on a rank (the throughput mode's and project_time's timing runs)
``convergence`` time to a held-out target (and project_time's timing runs)
``report``   summary rows, tables, projections, JSON/CSV and plots (``plot``: matplotlib, optional)
``gpu_step`` our own cost in one step at P = 1, every row against the plain loop and DDP (mode step);
             ``project_gpu`` projects such a step to GPU clusters in nodes over slow links
``zoo``      the models it trains (real architectures in plain torch.nn) and ``data`` their batches
``netem``    emulated slow networks on one machine (ip netns + veth + bridge + tc tbf)

The cost model stays in the library (``bagua_lite.cost_model``): ``algorithms/auto.py`` uses it.
"""
