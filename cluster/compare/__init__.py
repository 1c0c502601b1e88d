"""`vgrpo compare`: a matrix of runs (rows x seeds), their statistics and the report.

Owns: the comparison directory (compare.json, the report) and the rows' paired statistics. Each
row is an ordinary run (cluster.driver); this package reads finished runs, it never writes one's
state.
"""
