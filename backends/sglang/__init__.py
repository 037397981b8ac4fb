"""The adapter to SGLang: its real attention backends run as leaves of the matrix (see ``adapter.py``)."""
