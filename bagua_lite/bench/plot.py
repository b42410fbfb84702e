"""matplotlib for the benchmark's plots, optional: the matrix benchmark (``report``) and the step table
(``gpu_step``) draw with it when it is installed and say so when it is not."""
import sys


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (and a note) when matplotlib is not installed."""
    try:
        import matplotlib  # lazy: matplotlib is optional (the benchmark extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: matplotlib is optional
    except ImportError:
        print("benchmark: matplotlib not installed; no plot (pip install matplotlib)", file=sys.stderr)
        return None
    return plt
