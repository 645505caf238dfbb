"""Workloads: the canonical request schema, trace importers, synthetic generators, transforms."""
