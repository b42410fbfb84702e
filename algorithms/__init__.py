"""Relaxations of synchronous SGD, one per module (installed as ``bagua_lite.algorithms``).

``build(name, **options)`` instantiates a registered algorithm; ``register(name)`` makes a user's
``bagua_lite.Algorithm`` subclass selectable by name, in YAML too.
"""
from bagua_lite.algorithm import Algorithm, build, register, registered

from . import (async_model_average, decentralized, diloco, gradient_allreduce, gtopk, local_sgd,  # noqa: F401
               low_precision_decentralized, powersgd, qadam, topk)  # (register the built-ins)
from . import auto  # noqa: F401,E402  (last: it builds the others by name)

__all__ = ["Algorithm", "build", "register", "registered"]
