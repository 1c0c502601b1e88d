"""The reward role: reward models (scorers), the composite's heads, the reward actor and the
client that rollout actors call.

Owns: the loaded scorers and their calls in flight. Imports no other role.
"""
