"""The parts the relaxations in ``bagua_lite.algorithms`` are made of: what several of them share, and the
pieces one of them keeps apart from its class (README.md in this folder: which part, used by whom, for what).
Nothing here registers an algorithm."""
