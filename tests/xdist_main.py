"""The main module of a pytest-xdist worker as multiprocessing and pyspark see it (tests/conftest.py):
empty on purpose."""
