"""The orchestration layer: the only package that wires the roles together.

Owns: nothing of its own; each sub-package below names the state it owns. The roles and
`common` never import it (tests/test_architecture.py).
"""
