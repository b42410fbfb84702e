"""The benchmark tool, kept apart from the training runtime: ``python -m bagua_lite.bench --config ...``.

``runner``  launches the ranks (one network namespace each on emulated links), times the cells
``netem``   emulated slow networks on one machine (ip netns + veth + bridge + tc tbf)
``zoo``     the models it trains (real architectures in plain torch.nn)

The cost model stays in the library (``bagua_lite.cost_model``): ``algorithms/auto.py`` uses it.
"""
