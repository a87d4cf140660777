"""Upstream iris's ``iris.experimental`` package: ``iris.experimental.iris_gluon``."""
