"""The shipped YAML configs, installed as ``bagua_lite.configs``: ``bagua_lite.load_config("gtopk")``.

``<algorithm>.yaml`` shows that algorithm's defaults (the same as ``algorithm="<algorithm>"``); the other
files are named variants (``bytegrad``, ``signsgd``, ``sparseloco``, ``streaming_diloco``, ...) and benchmark
matrices (``benchmark*``).
"""
