"""Oracles of the tests: the formulas of the papers and the official code written out
independently of the package's code paths (float64, explicit loops or products)."""
