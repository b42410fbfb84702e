"""Deprecated alias: ``python -m bagua_lite.benchmark ...`` runs ``python -m bagua_lite.bench ...``."""
if __name__ == "__main__":
    import sys; print("bagua_lite.benchmark is deprecated: use python -m bagua_lite.bench", file=sys.stderr); from bagua_lite.bench.runner import main; main()  # noqa: E501,E702
