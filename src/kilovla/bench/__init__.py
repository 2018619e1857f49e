"""Benchmark suites behind `kilovla bench <suite>`: each prints a table and writes DIR/<suite>.json."""
