"""Prints, as JSON, the kept outputs each policy of the rule's grid serves over one step, as an
audit sees it, under the engine this interpreter runs (SAC_PLUGIN_ENGINE)."""

import json

from support.every_kind_of_call import hits_per_policy

print(json.dumps(hits_per_policy()))
