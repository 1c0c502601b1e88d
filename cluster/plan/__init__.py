"""`vgrpo plan` and the preflight's arithmetic: memory, time, bank and host sizing per role.

Owns: nothing at run time; pure functions of a config (and the family, method and scorer
declarations in `common`). Benchmarks import it.
"""
