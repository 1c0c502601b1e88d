"""Pure logic every role imports: the config schema, SDE schemes, the declarations of methods,
model families and scorers, data types, the weights format, fan-out verbs, errors.

Owns: the contracts between roles (types, wire formats, names). It imports no role and never
`cluster`; it holds no process state.
"""
