"""Deprecated: the benchmark moved to ``bagua_lite.bench``; ``python -m bagua_lite.benchmark`` forwards there."""
if __name__ == "__main__":
    from bagua_lite.bench.runner import main; main()  # noqa: E702
