# A package, so that this tier's conftest is imported as cluster.conftest and does
# not take the place of tests/conftest.py (both would be the module "conftest").
