"""Tests of the adapters to real engines: each module skips when its engine does not import."""
