"""`loraplex bench`: a seeded multi-tenant workload driven through loraplex and a
transformers + peft baseline, reported as a table, JSON and a plot.

Imports here stay light (standard library only) so `loraplex --help` does not
pay for torch; each module imports what it needs.
"""
