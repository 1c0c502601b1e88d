"""The rollout role: model adapters (`rollout_worker.models`), the SDE sampler and the rollout
actor.

Owns: the rollout model's weights as received (which version it holds is reported to, and
recorded by, the driver), the encoded conditions it makes and the groups it stages until they are
delivered. Imports of other roles: `reward_worker` (its data-plane client) and `memory_bank`
(it pushes scored groups).
"""
