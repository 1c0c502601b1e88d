"""Health checks of a run: pure checks over step records, and the driver's hook.

Owns: the findings and health.json; it reads the driver's step records and never changes the
run's state (a check that stops a run asks the driver through its hook).
"""
