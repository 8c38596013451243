"""Prints, as JSON, the kept outputs each policy of the rule's grid, and each policy keeping the
transposed F.linear's mm, serves over one step, as an audit sees it, under the engine this
interpreter runs (SAC_PLUGIN_ENGINE)."""

import json

from support.every_kind_of_call import LINEAR_POLICIES, hits_per_policy, linear_layer_and_input

print(json.dumps({"grid": hits_per_policy(), "linear": hits_per_policy(LINEAR_POLICIES, linear_layer_and_input)}))
